"""Capture real gradients from a few training steps of small Keras models.

The codec benchmarks and notebooks need gradients that look like the ones a
data-parallel job sends, not Gaussian noise. This script trains three models on
scikit-learn's bundled digits (1,797 8x8 images, nothing is downloaded) and saves
the gradients of chosen steps to an ``.npz`` file:

``cnn``
    A small convolutional network on the 8x8 images (about 40k parameters).
``resnet20``
    The CIFAR ResNet-20 shape of He et al. (3 stages x 3 basic blocks, 16/32/64
    channels, parameter-free "option A" shortcuts, about 270k parameters) on the
    digits upsampled to 32x32 with ``tf.image.resize``.
``embedding``
    A bag-of-tokens classifier. Each image becomes 176 tokens: every pixel's
    (position, value) and every horizontal and vertical neighbour pair's
    (pair, coarse value, coarse value). The 2,880 x 64 embedding table gets a
    ``tf.IndexedSlices`` gradient, as embeddings do in real models.

File layout
-----------
``"<model>/<variable>"``
    float32 gradient with the variable's shape (IndexedSlices are densified:
    rows looked up several times are summed, rows never looked up are zero).
``"<model>/<variable>.indexed_values"``, ``"<model>/<variable>.indexed_indices"``
    For IndexedSlices gradients only: the sparse form exactly as TensorFlow
    produced it, float32 rows and int64 row ids, one row per lookup (ids repeat).
    This is what Horovod's allgather path for IndexedSlices sends.

With several ``--save-steps`` the keys are ``"<model>/step<k>/<variable>"``.
Step ``k``'s gradient is computed on the weights after ``k - 1`` updates.
Variable names are the Keras ones without the ``:0`` suffix, with characters
outside ``[A-Za-z0-9_.-]`` replaced by ``_`` per path component.

Runs are deterministic for a given seed (op determinism is switched on, the
batches come from a seeded numpy generator, each model is seeded on its own so
its gradients do not depend on which other models are chosen).

Examples
--------
As a script, from the repository root::

    python -m benchmarks.gradients --out benchmarks/cache/gradients.npz \\
        --steps 20 --models cnn,resnet20,embedding

As a module, from the repository root::

    from benchmarks.gradients import capture
    grads = capture(models=("cnn",), steps=2)   # {"cnn/...": ndarray}
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

import numpy as np

# Nothing from benchmarks.common: the notebooks import this file by its folder, as `gradients`.

MODELS = ("cnn", "resnet20", "embedding")
NUM_CLASSES = 10
PIXEL_LEVELS = 17          # digits pixels are integers 0..16
PAIR_LEVELS = 4            # neighbour-pair tokens use a coarser value scale
IMAGE_SIDE = 8
RESNET_SIDE = 32


def load_digits_data():
    """Digits images scaled to [0, 1] as (N, 8, 8) float32, raw 0..16 ints, labels."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    raw = digits.images.astype(np.int64)
    return (raw / (PIXEL_LEVELS - 1)).astype(np.float32), raw, digits.target.astype(np.int64)


def _horizontal_and_vertical_pairs():
    grid = np.arange(IMAGE_SIDE * IMAGE_SIDE).reshape(IMAGE_SIDE, IMAGE_SIDE)
    first = np.concatenate([grid[:, :-1].ravel(), grid[:-1, :].ravel()])
    second = np.concatenate([grid[:, 1:].ravel(), grid[1:, :].ravel()])
    return first, second


def embedding_vocabulary_size():
    """Rows of the embedding table: pixel tokens plus neighbour-pair tokens."""
    pairs = len(_horizontal_and_vertical_pairs()[0])
    return IMAGE_SIDE * IMAGE_SIDE * PIXEL_LEVELS + pairs * PAIR_LEVELS ** 2


def digits_to_tokens(raw):
    """Token ids (N, 176) of raw 0..16 digit images (N, 8, 8).

    Token ``p * 17 + v`` says "pixel p has value v"; after those 1,088 ids come
    the pair tokens "neighbour pair j has coarse values (a, b)".
    """
    flat = raw.reshape(len(raw), -1)
    pixel_tokens = np.arange(flat.shape[1]) * PIXEL_LEVELS + flat
    coarse = flat * PAIR_LEVELS // PIXEL_LEVELS
    first, second = _horizontal_and_vertical_pairs()
    pair_codes = coarse[:, first] * PAIR_LEVELS + coarse[:, second]
    pair_tokens = (flat.shape[1] * PIXEL_LEVELS
                   + np.arange(len(first)) * PAIR_LEVELS ** 2 + pair_codes)
    return np.concatenate([pixel_tokens, pair_tokens], axis=1)


def build_cnn(tf):
    layers = tf.keras.layers
    inputs = tf.keras.Input((IMAGE_SIDE, IMAGE_SIDE, 1), name="image")
    x = layers.Conv2D(16, 3, padding="same", activation="relu", name="conv1")(inputs)
    x = layers.Conv2D(32, 3, padding="same", activation="relu", name="conv2")(x)
    x = layers.MaxPooling2D(2, name="pool")(x)
    x = layers.Flatten(name="flatten")(x)
    x = layers.Dense(64, activation="relu", name="fc1")(x)
    outputs = layers.Dense(NUM_CLASSES, name="logits")(x)
    return tf.keras.Model(inputs, outputs, name="cnn")


def _conv_bn(tf, x, filters, stride, name, relu=True):
    layers = tf.keras.layers
    x = layers.Conv2D(filters, 3, strides=stride, padding="same", use_bias=False,
                      kernel_initializer="he_normal", name=f"{name}_conv")(x)
    x = layers.BatchNormalization(name=f"{name}_bn")(x)
    return layers.ReLU(name=f"{name}_relu")(x) if relu else x


def _option_a_shortcut(tf, x, filters, name):
    """Subsample by 2 and zero-pad the new channels: the shortcut adds no weights."""
    extra = filters - x.shape[-1]

    def shortcut(t):
        return tf.pad(t[:, ::2, ::2, :], [[0, 0], [0, 0], [0, 0],
                                          [extra // 2, extra - extra // 2]])

    return tf.keras.layers.Lambda(shortcut, name=f"{name}_shortcut")(x)


def build_resnet20(tf):
    layers = tf.keras.layers
    inputs = tf.keras.Input((RESNET_SIDE, RESNET_SIDE, 1), name="image")
    x = _conv_bn(tf, inputs, 16, 1, "stem")
    for stage, filters in enumerate((16, 32, 64), start=1):
        for block in range(1, 4):
            name = f"stage{stage}_block{block}"
            stride = 2 if stage > 1 and block == 1 else 1
            shortcut = _option_a_shortcut(tf, x, filters, name) if stride == 2 else x
            y = _conv_bn(tf, x, filters, stride, f"{name}_a")
            y = _conv_bn(tf, y, filters, 1, f"{name}_b", relu=False)
            x = layers.ReLU(name=f"{name}_out")(layers.Add(name=f"{name}_add")([y, shortcut]))
    x = layers.GlobalAveragePooling2D(name="pool")(x)
    outputs = layers.Dense(NUM_CLASSES, name="logits")(x)
    return tf.keras.Model(inputs, outputs, name="resnet20")


def build_embedding(tf, tokens_per_sample):
    layers = tf.keras.layers
    inputs = tf.keras.Input((tokens_per_sample,), dtype="int64", name="tokens")
    x = layers.Embedding(embedding_vocabulary_size(), 64, name="embed")(inputs)
    x = layers.GlobalAveragePooling1D(name="bag")(x)
    x = layers.Dense(64, activation="relu", name="fc1")(x)
    outputs = layers.Dense(NUM_CLASSES, name="logits")(x)
    return tf.keras.Model(inputs, outputs, name="embedding")


def model_inputs(tf, name, images, raw):
    """The whole digits set as the chosen model's input tensor."""
    if name == "cnn":
        return tf.constant(images[..., None])
    if name == "resnet20":
        return tf.image.resize(images[..., None], (RESNET_SIDE, RESNET_SIDE))
    if name == "embedding":
        return tf.constant(digits_to_tokens(raw))
    raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")


def build_model(tf, name, inputs):
    if name == "cnn":
        return build_cnn(tf)
    if name == "resnet20":
        return build_resnet20(tf)
    if name == "embedding":
        return build_embedding(tf, inputs.shape[1])
    raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")


def variable_key(variable_name):
    """npz-safe key part of a Keras variable name: no ':0', only [A-Za-z0-9_.-] per part."""
    name = re.sub(r":\d+$", "", variable_name)
    return "/".join(re.sub(r"[^A-Za-z0-9_.-]", "_", part) for part in name.split("/"))


def _gradient_arrays(tf, key, variable, gradient):
    if isinstance(gradient, tf.IndexedSlices):
        dense = tf.math.unsorted_segment_sum(gradient.values, gradient.indices,
                                             variable.shape[0])
        yield key, dense.numpy().astype(np.float32)
        yield key + ".indexed_values", gradient.values.numpy().astype(np.float32)
        yield key + ".indexed_indices", gradient.indices.numpy().astype(np.int64)
    else:
        yield key, gradient.numpy().astype(np.float32)


def make_optimizer(tf, name):
    """SGD with momentum for the image models; Adam for the embedding model, whose
    rows each get a 1/176 share of the pooled gradient and barely move under SGD."""
    if name == "embedding":
        return tf.keras.optimizers.Adam(learning_rate=0.01)
    return tf.keras.optimizers.SGD(learning_rate=0.05, momentum=0.9)


def train_and_capture(tf, name, steps, save_steps, batch_size, seed, data):
    """Train model ``name`` for ``steps`` steps; return {step: {key: array}} for save_steps."""
    images, raw, labels = data
    tf.keras.utils.set_random_seed(seed)
    inputs = model_inputs(tf, name, images, raw)
    model = build_model(tf, name, inputs)
    optimizer = make_optimizer(tf, name)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    batches = np.random.default_rng(seed)
    captured = {}
    for step in range(1, steps + 1):
        batch = batches.choice(len(labels), size=batch_size, replace=False)
        with tf.GradientTape() as tape:
            logits = model(tf.gather(inputs, batch), training=True)
            loss = loss_fn(labels[batch], logits)
        variables = model.trainable_variables
        gradients = tape.gradient(loss, variables)
        if step in save_steps:
            captured[step] = {
                array_key: array
                for variable, gradient in zip(variables, gradients)
                for array_key, array in _gradient_arrays(
                    tf, variable_key(variable.name), variable, gradient)}
        optimizer.apply_gradients(zip(gradients, variables))
    return captured, float(loss), model.count_params()


def capture(models=MODELS, steps=20, save_steps=None, batch_size=64, seed=0, verbose=False):
    """Train each model and return the gradients as ``{key: ndarray}`` (layout above).

    Parameters
    ----------
    models : sequence of str
        Any of ``"cnn"``, ``"resnet20"``, ``"embedding"``.
    steps : int
        Training steps per model (see :func:`make_optimizer`; a step's batch is drawn
        without replacement).
    save_steps : sequence of int, optional
        Steps (1-based) whose gradients are kept; default: the last step only.
    batch_size : int
        Examples per step, at most 1,797 (the size of the digits set).
    seed : int
        Seeds the weights and the batch order.
    verbose : bool
        Print one line per trained model.

    Notes
    -----
    Switches on TensorFlow's op determinism for the whole process, because the
    point of a gradient cache is that reruns give the same bits.
    """
    import tensorflow as tf

    models = tuple(models)
    unknown = [m for m in models if m not in MODELS]
    if unknown or not models:
        raise ValueError(f"models must be a non-empty subset of {', '.join(MODELS)}, "
                         f"got {', '.join(models) or 'nothing'}")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    save_steps = sorted(set(save_steps or (steps,)))
    if save_steps[0] < 1 or save_steps[-1] > steps:
        raise ValueError(f"save_steps must lie in [1, {steps}], got {save_steps}")
    data = load_digits_data()
    if not 1 <= batch_size <= len(data[2]):
        raise ValueError(f"batch_size must lie in [1, {len(data[2])}], got {batch_size}")

    tf.config.experimental.enable_op_determinism()
    result = {}
    for name in models:
        started = time.perf_counter()
        captured, loss, params = train_and_capture(tf, name, steps, set(save_steps),
                                                   batch_size, seed, data)
        for step, arrays in captured.items():
            prefix = name if len(save_steps) == 1 else f"{name}/step{step}"
            result.update({f"{prefix}/{key}": array for key, array in arrays.items()})
        if verbose:
            print(f"{name}: {params:,} parameters, {steps} steps, final loss {loss:.4f}, "
                  f"{time.perf_counter() - started:.1f} s", flush=True)
    return result


def summary(arrays):
    """A plain-text table: one line per array, then the totals."""
    width = max(len(key) for key in arrays)
    lines = [f"{'array':<{width}}  {'shape':>16}  {'dtype':>7}  {'elements':>10}  "
             f"{'nonzero':>8}  {'bytes':>10}"]
    for key, array in arrays.items():
        nonzero = np.count_nonzero(array) / max(array.size, 1)
        lines.append(f"{key:<{width}}  {str(array.shape):>16}  {str(array.dtype):>7}  "
                     f"{array.size:>10,}  {nonzero:>8.2%}  {array.nbytes:>10,}")
    gradient_keys = [k for k in arrays if not k.endswith((".indexed_values", ".indexed_indices"))]
    lines.append(f"{len(gradient_keys)} gradient tensors, "
                 f"{sum(arrays[k].size for k in gradient_keys):,} elements, "
                 f"{sum(arrays[k].nbytes for k in gradient_keys):,} bytes dense "
                 f"({len(arrays) - len(gradient_keys)} extra arrays for IndexedSlices, "
                 f"{sum(a.nbytes for a in arrays.values()):,} bytes in all)")
    return "\n".join(lines)


def _int_list(text):
    try:
        return [int(part) for part in text.split(",") if part]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")


def main(argv=None):
    parser = argparse.ArgumentParser(
        description="Train small Keras models on scikit-learn's digits for a few steps "
                    "and save their gradients to an .npz file.")
    parser.add_argument("--out", default="benchmarks/cache/gradients.npz",
                        help="output .npz path (default: %(default)s)")
    parser.add_argument("--models", default=",".join(MODELS),
                        help="comma-separated subset of %(default)s")
    parser.add_argument("--steps", type=int, default=20,
                        help="training steps per model (default: %(default)s)")
    parser.add_argument("--save-steps", type=_int_list, default=None,
                        help="comma-separated 1-based steps to save (default: the last)")
    parser.add_argument("--batch-size", type=int, default=64,
                        help="examples per step (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="default: %(default)s")
    args = parser.parse_args(argv)

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    started = time.perf_counter()
    try:
        arrays = capture(models=[m for m in args.models.split(",") if m], steps=args.steps,
                         save_steps=args.save_steps, batch_size=args.batch_size,
                         seed=args.seed, verbose=True)
    except ValueError as error:
        parser.error(str(error))
    out_dir = os.path.dirname(args.out)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
    np.savez(args.out, **arrays)
    print(summary(arrays))
    print(f"wrote {args.out} ({os.path.getsize(args.out):,} bytes) in "
          f"{time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
