"""Measuring instruments shared by the tools (``memory``, ``bench``, ``compare``...).

- ``storage``: bytes of distinct tensor storages; ``LiveBytes``, the storages alive and their peak.
- ``activations``: what autograd saves for backward (``SavedTensorMeter``), activation memory.
- ``timing``: interleaved rounds, device-honest clocks, medians, paired ratios, host-sync counts.

They import torch and numpy only: no tool, no report, no CLI. A tool that needs a measurement
another tool also makes takes it from here, never from the other tool.
"""
