"""Test-suite settings: one torch thread per process.

The tests run on 2-core machines that are often busy; torch's default of one thread per core then
slows small ops by orders of magnitude (oversubscription). One thread is also what the benchmark
tables assume, and it keeps float reductions in the same order on every machine.
"""

import torch

torch.set_num_threads(1)
