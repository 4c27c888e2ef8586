"""What the Horovod worker scripts share (tests/horovod_workers.py and
horovod_hierarchical_workers.py): a rank's shard of the digits data set, the small
Keras model trained on it and a training step on DistributedGradientTape. Imported by
path-launched scripts, where tests/ is sys.path[0]."""

import numpy as np
import tensorflow as tf

import deepreduce.horovod.tensorflow as drh


def digits_shard(rank, size):
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / 16.0 - 0.3).astype(np.float32)
    y = digits.target.astype(np.int64)
    return x[rank::size], y[rank::size]


def small_model():
    tf.keras.utils.set_random_seed(0)
    return tf.keras.Sequential([tf.keras.Input(shape=(64,)),
                                tf.keras.layers.Dense(128, activation="relu"),
                                tf.keras.layers.Dense(10)])


def tape_step(model, optimizer, compression, loss_fn, xb, yb):
    """One optimizer step on the gradients of ``compression``'s DistributedGradientTape;
    returns the loss (eagerly, or traced inside the caller's tf.function)."""
    with tf.GradientTape() as tape:
        loss = loss_fn(yb, model(xb, training=True))
    tape = drh.DistributedGradientTape(tape, compression=compression)
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return loss
