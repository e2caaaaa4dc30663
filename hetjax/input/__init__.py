"""The input family: the global sampler and shuffle, sources (memory, synthetic,
TFDS on disk, encoded images), augmentation and the loader's workers.

Everything here is numpy and stdlib (TFDS only where a TFDS source is used):
the step never sees where its records came from.
"""
