"""brace_lightning: asynchronous PPO for language models on PyTorch Lightning.

Value targets (PPO-GAE, V-trace, BRACE) live in :mod:`brace_lightning.targets`, actor objectives in
:mod:`brace_lightning.objectives`, the LightningModule in :mod:`brace_lightning.module`.
"""

__version__ = "0.1.0"
