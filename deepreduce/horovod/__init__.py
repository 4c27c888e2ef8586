"""Horovod integrations: deepreduce payloads as the gradients of data-parallel training.

``import deepreduce.horovod.tensorflow as drh`` (TensorFlow 2 / Keras 2 with
Horovod) is the user-facing module. :mod:`deepreduce.exchange` (bundle
framing, compression and reduction in numpy) and :mod:`deepreduce.exchange.stats`
need neither TensorFlow nor Horovod; importing this package imports neither.
"""
