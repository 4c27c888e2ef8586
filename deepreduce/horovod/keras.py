"""Keras callback reporting what deepreduce compression sent and how long it took."""

from __future__ import annotations

import tensorflow as tf


class CompressionStatsCallback(tf.keras.callbacks.Callback):
    """Log ``compression.stats`` per epoch into Keras logs, and per step to TensorBoard.

    At the end of every epoch the per-step means of that epoch are added to the
    epoch logs (so ``History`` keeps them) under ``prefix``: ``bytes_sent``,
    ``dense_bytes``, ``ratio``, ``encode_ms``, ``decode_ms``, ``exchange_ms``,
    ``codec_ms`` (see :class:`~deepreduce.exchange.stats.StepStats`). With ``log_dir``,
    every training step's values are also written with ``tf.summary`` (as
    ``prefix + key``, step = number of exchanged steps), and the epoch means
    as ``prefix + "epoch_" + key``.

    Parameters
    ----------
    compression : deepreduce.horovod.tensorflow.Compression
        The object given to ``drh.DistributedOptimizer``.
    log_dir : str, optional
        TensorBoard log directory; give it on one rank only (usually rank 0).
    prefix : str, default "dr_"
        Prefix of the log keys.

    Examples
    --------
    ::

        compression = drh.Compression(sparsifier=dr.TopK(0.01), value="fp16")
        model.compile(optimizer=drh.DistributedOptimizer(opt, compression=compression), ...)
        callbacks = [drh.CompressionStatsCallback(compression,
                                                  log_dir="logs" if hvd.rank() == 0 else None)]
        history = model.fit(x, y, callbacks=callbacks)
        history.history["dr_ratio"]        # one value per epoch
    """

    KEYS = ("bytes_sent", "dense_bytes", "ratio", "encode_ms", "decode_ms", "exchange_ms",
            "codec_ms")

    def __init__(self, compression, log_dir=None, prefix: str = "dr_"):
        super().__init__()
        self.compression, self.prefix = compression, prefix
        self.log_dir = log_dir
        self._writer = tf.summary.create_file_writer(log_dir) if log_dir else None
        self._epoch_start = compression.stats.snapshot()
        self._logged_steps = compression.stats.total.steps

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch_start = self.compression.stats.snapshot()

    def on_train_batch_end(self, batch, logs=None):
        if self._writer is None:
            return
        stats = self.compression.stats
        steps = stats.total.steps
        if steps == self._logged_steps:  # no exchange since the last batch
            return
        self._logged_steps = steps
        last = stats.last.per_step()
        with self._writer.as_default():
            for key in self.KEYS:
                tf.summary.scalar(self.prefix + key, last[key], step=steps)

    def on_epoch_end(self, epoch, logs=None):
        epoch_stats = (self.compression.stats.snapshot() - self._epoch_start).per_step()
        values = {self.prefix + key: epoch_stats[key] for key in self.KEYS}
        if logs is not None:
            logs.update(values)
        if self._writer is not None:
            with self._writer.as_default():
                for key in self.KEYS:
                    tf.summary.scalar(self.prefix + "epoch_" + key, epoch_stats[key], step=epoch)
            self._writer.flush()

    def on_train_end(self, logs=None):
        if self._writer is not None:
            self._writer.flush()
