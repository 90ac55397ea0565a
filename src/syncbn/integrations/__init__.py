"""Optional glue between syncbn and other libraries, one module per library.

- :mod:`syncbn.integrations.timm`: a synchronized twin of timm's ``BatchNormAct2d`` and its
  converters, which :func:`syncbn.convert_sync_batchnorm` loads the first time it meets a timm
  class (``syncbn._conversion.BUILT_IN_CONVERTERS``; ``pip install "syncbn[timm]"``).
- :mod:`syncbn.integrations.lightning`: ``SyncBatchNormPlugin``, a Lightning ``LayerSync``
  plugin (``pip install "syncbn[lightning]"``).

Nothing here is imported by ``import syncbn``; each module imports its library, and importing
one registers nothing by itself.
"""
