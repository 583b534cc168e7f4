"""Benchmarks: what mixed precision buys on this machine, and what mixprec's step costs.

- ``block``: the reference transformer block, its shapes and its analytic FLOP count.
- ``timing``: interleaved rounds, device-honest clocks, medians, paired ratios, sync counting.
- ``peak``: the matmul ceiling per dtype, measured in the same run; the TF32 switch.
- ``memory``: activation memory (bytes saved for backward; CUDA allocator deltas).
- ``runner``: every recipe on the block (``mixprec bench``).
- ``overhead``: ``MixedPrecision.step`` against the hand-written torch.amp loop (``mixprec bench --overhead``).
- ``tables``: rich and Markdown tables from the JSON results.
"""
