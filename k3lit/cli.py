"""The ``k3lit`` command: LightningCLI sub-commands (fit, validate, test, predict) plus prepare, generate, export,
positions and slurm.

    k3lit fit --config recipes/tiny.yaml --model.n_layers=4 --trainer.max_steps=100
    k3lit fit --config recipes/tiny.yaml --ckpt_path last          # resume (architecture from the checkpoint)
    k3lit fit --config recipes/small_32k.yaml --init_weights runs/small/checkpoints/last.ckpt  # continue training
    k3lit prepare --config recipes/tiny.yaml                       # tokenise the corpus into litdata chunks
    k3lit generate --ckpt runs/tiny/checkpoints/last.ckpt --prompt "def "
    k3lit positions --ckpt runs/tiny/checkpoints/last.ckpt --png positions.png  # bpb by position, longer inputs
    k3lit slurm --config recipes/small.yaml --nodes 1 --gpus_per_node 1 > job.sbatch  # see k3lit.slurm

Recipes have four sections: ``model`` (:class:`~k3lit.model.ModelConfig`), ``optim``
(:class:`~k3lit.train.optim.OptimConfig`), ``data`` (:class:`~k3lit.data.K3DataModule`) and ``trainer``.
Unless a recipe sets them, runs log to TensorBoard and ``metrics.csv``, keep ``checkpoints/last.ckpt`` and draw
the MoE load heatmap (``expert_load/``), all under ``trainer.default_root_dir``; the resolved config is saved
beside them as ``config.yaml``. A run shows its progress in optimizer steps against ``max_steps`` or
``max_time``, whichever ends it first (a live bar on a terminal, plain lines in a log), and a summary when it ends.

``trainer.val_check_interval`` as an integer counts optimizer steps over the whole run, whatever an epoch's
length (``check_val_every_n_epoch`` defaults to null; with gradient accumulation Lightning gets
``val_check_interval x accumulate_grad_batches`` training batches); ``last.ckpt`` and the heatmap are written at
the same interval and when training ends. A time (``DD:HH:MM:SS``) validates, checkpoints and plots every so many
seconds of training; a fraction of an epoch, or an explicit ``check_val_every_n_epoch``, keeps Lightning's
per-epoch meaning (``last.ckpt`` and the heatmap then every 100 steps). On one device and under DDP, ``last.ckpt``
is written by a background thread while training goes on
(:class:`~k3lit.train.checkpoint_background.BackgroundCheckpointIO`).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import re
import sys
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, NoReturn

import torch
from jsonargparse import ActionConfigFile, ArgumentParser
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.accelerators import CUDAAccelerator
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, SingleDeviceStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from k3lit import lightning_compat as compat
from k3lit.data import K3DataModule
from k3lit.data.datamodule import tokenizer_from_state
from k3lit.data.tokenizer import parse_tokenizer_spec
from k3lit.model import K3LM, RUNTIME_FIELDS, ModelConfig, check_sampling
from k3lit.parallel.process_exit import exit_process
from k3lit.train.callbacks import K3ThroughputMonitor, LastCheckpoint, SlurmRequeue
from k3lit.train.checkpoint import (
    CheckpointError,
    check_checkpoint,
    checkpoint_hparams,
    checkpoint_record,
    load_model_checkpoint,
    tokenizer_error,
)
from k3lit.train.checkpoint_background import BackgroundCheckpointIO
from k3lit.train.checkpoint_save import DirectCheckpointIO, K3Trainer, is_local_path, settle, settle_folder
from k3lit.train.csv_log import RunCSVLogger
from k3lit.train.expert_plots import ExpertLoadPlots
from k3lit.train.garbage import GarbageCollection
from k3lit.train.kernel_precompile import KernelPrecompile
from k3lit.train.module import COMPILE_MODES, K3LitModule
from k3lit.train.optim import OptimConfig
from k3lit.train.progress import ProgressLines, StepProgressBar
from k3lit.train.quiet import quiet_third_party, quiet_validate
from k3lit.train.summary import RunSummary, process_age_s
from k3lit.train.tensorboard_log import RunTensorBoardLogger

DEFAULT_EVERY_N_STEPS = 100  # checkpoint and heatmap interval when val_check_interval is neither steps nor a time
SCORING = ("validate", "test", "predict")  # the sub-commands that read trained weights (--ckpt_path) and train none


def _instantiate(parser: ArgumentParser, cfg: Any) -> Any:
    """``parser.instantiate`` (jsonargparse >= 4.49), else its older name ``instantiate_classes``."""
    instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes
    return instantiate(cfg)


class K3ArgumentParser(LightningArgumentParser):
    """LightningCLI's parser with a short error: one usage line instead of the full usage (about 90 lines of
    options, printed before the error), and for an unknown option the closest known ones. Options must be spelled
    out: argparse would take a prefix of one option for it (``--model.n_layer`` for ``--model.n_layers``), so a
    typo could set another field than the one meant."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def print_usage(self, file: Any = None) -> None:
        print(f"usage: {self.prog} [options]", file=file or sys.stderr)

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        if "unrecognized arguments" in message:
            parser = getattr(ex, "subcommand_parser", None) or self
            known = list(parser._option_string_actions)
            for flag in re.findall(r"--[\w.-]+", message):
                close = difflib.get_close_matches(flag, known, n=3, cutoff=0.75)
                if close:
                    message += f"\n  {flag}: did you mean {' or '.join(close)}?"
        super().error(message, ex)


class K3CLI(LightningCLI):
    """LightningCLI whose ``model`` group is the :class:`ModelConfig` dataclass itself (``--model.dim``), with
    ``optim`` beside it; the LightningModule is built from both after the data module fixes the vocabulary. Its
    trainer is a :class:`~k3lit.train.checkpoint_save.K3Trainer`: a killed save leaves no half-written checkpoint."""

    def __init__(self, args: list[str] | None = None, run: bool = True) -> None:
        self._imported_age = process_age_s()  # the first SETUP_MARKS mark: k3lit and its libraries imported
        quiet_third_party()
        super().__init__(
            K3LitModule,
            K3DataModule,
            auto_configure_optimizers=False,
            save_config_kwargs={"overwrite": True},
            trainer_class=K3Trainer,
            trainer_defaults={"check_val_every_n_epoch": None},  # val_check_interval: steps over the whole run
            parser_class=K3ArgumentParser,
            args=args,
            run=run,
        )

    def add_core_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # model, optim and data first: --help lists the groups in this order, Lightning's trainer flags last
        parser.add_class_arguments(ModelConfig, "model")
        parser.add_class_arguments(OptimConfig, "optim")
        parser.add_lightning_class_args(K3DataModule, "data")
        parser.add_argument("--compile", type=bool | None, default=None,
                            help="torch.compile the model; default: on for one CUDA device without a sharding "
                                 "strategy, off otherwise")
        parser.add_argument("--compile_scope", type=Literal["sublayers", "model"], default="sublayers",
                            help="'sublayers': each sublayer on its own (faster start-up); 'model': the whole "
                                 "model as one graph on one device (slightly faster steps; RESULTS.md, Throughput)")
        parser.add_argument("--compile_mode", type=Literal[COMPILE_MODES] | None, default=None,
                            help="torch.compile's mode (null: its default); 'reduce-overhead': CUDA graphs of each "
                                 "compiled region (recipes/small.yaml's setting)")
        parser.add_argument("--init_weights", type=str | None, default=None,
                            help="fit only: start from the model weights of this checkpoint (file or sharded folder; "
                                 "its architecture and tokenizer, any seq_len) with a fresh optimizer, schedule, "
                                 "step count and data order; ignored when --ckpt_path resumes a run")
        parser.add_argument("--float32_matmul_precision", type=Literal["highest", "high", "medium"], default="high",
                            help="torch.set_float32_matmul_precision on CUDA devices: 'high' = TF32 products for "
                                 "float32 matmuls (the router's, and all of them under 32-true); 'highest' = IEEE")
        parser.add_lightning_class_args(self.trainer_class, "trainer")
        parser.set_defaults({"trainer." + k: v for k, v in self.trainer_defaults.items() if k != "callbacks"})

    def _value(self, config: Any, key: str, default: Any = None) -> Any:
        """``key`` of the sub-command's section of ``config`` (or of ``config`` itself without a sub-command)."""
        return config.get(str(self.subcommand), config).get(key, default)

    def instantiate_classes(self) -> None:
        ages = {"imported": self._imported_age, "parsed": process_age_s()}  # RunSummary's first marks (SETUP_MARKS)
        self.config_init = _instantiate(self.parser, self.config)
        if self.subcommand == "validate":
            quiet_validate()
        self.datamodule = self._value(self.config_init, "data")
        ages["data"] = process_age_s()
        accelerator = self._value(self.config_init, "trainer", default={}).get("accelerator")
        if accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
            raise ValueError(f"trainer.accelerator={accelerator}, and torch finds no CUDA device on this machine: "
                             "train recipes/tiny.yaml here (make train), or pass --trainer.accelerator=cpu (slow for "
                             "a GPU recipe)")
        self.trainer = self.instantiate_trainer(**self._trainer_kwargs())
        ages["trainer"] = process_age_s()
        if type(self.trainer.strategy.checkpoint_io) is TorchCheckpointIO:  # Lightning's default, not a configured one
            one_file = type(self.trainer.strategy) in (SingleDeviceStrategy, DDPStrategy)  # rank 0 writes one file
            self.trainer.strategy.checkpoint_io = BackgroundCheckpointIO() if one_file else DirectCheckpointIO()
        if isinstance(self.trainer.accelerator, CUDAAccelerator):
            torch.set_float32_matmul_precision(self._value(self.config_init, "float32_matmul_precision", "high"))
        model_cfg: ModelConfig = self._value(self.config_init, "model")
        ckpt_path = self._resolve_ckpt_path()
        if ckpt_path is not None and Path(ckpt_path).is_dir() \
                and not isinstance(self.trainer.strategy, ModelParallelStrategy):
            raise ValueError(f"--ckpt_path {ckpt_path} is a sharded checkpoint (torch distributed checkpoint shards), "
                             "which loads under ModelParallelStrategy on any number of processes; on one: "
                             "--trainer.strategy=ModelParallelStrategy --trainer.strategy.data_parallel_size=1 "
                             "--trainer.strategy.tensor_parallel_size=1 (k3lit generate, positions and export read "
                             "it as it is)")
        if ckpt_path is not None:
            model_cfg = self._checkpoint_architecture(ckpt_path, model_cfg)
            self._align_with_checkpoint(ckpt_path)
        init_weights = self._init_weights(ckpt_path)
        if ckpt_path is None and self.subcommand in SCORING:
            raise ValueError(f"k3lit {self.subcommand} scores trained weights: add --ckpt_path (a checkpoint file, a "
                             "sharded folder, or `last`: the run folder's checkpoints/last.ckpt)")
        if init_weights is not None:
            model_cfg = self._checkpoint_architecture(init_weights, model_cfg, flag="--init_weights")
        for logger in self.trainer.loggers:  # continue metrics.csv and the events only when a checkpoint is loaded
            if isinstance(logger, RunCSVLogger | RunTensorBoardLogger):
                logger.append = ckpt_path is not None
        for cb in self.trainer.callbacks:  # and keep last.ckpt and the heatmaps; a fresh run moves earlier ones aside
            if isinstance(cb, LastCheckpoint | ExpertLoadPlots):
                cb.resume = ckpt_path is not None
        data_vocab = self.datamodule.vocab_size
        if model_cfg.vocab_size is None:
            model_cfg = dataclasses.replace(model_cfg, vocab_size=data_vocab)
        elif model_cfg.vocab_size < data_vocab:
            raise ValueError(
                f"model.vocab_size={model_cfg.vocab_size} is smaller than the tokenizer's {data_vocab}: "
                "remove model.vocab_size to take it from the data, or raise it"
            )
        if model_cfg.document_masking and model_cfg.eos_id is None:  # recorded in the config.yaml saved beside the run
            model_cfg = dataclasses.replace(model_cfg, eos_id=self.datamodule.eos_id)
            (self.config[self.subcommand] if self.subcommand else self.config)["model.eos_id"] = model_cfg.eos_id
        # A sharding strategy gets a meta-device model: each rank materialises only its shards (configure_model)
        self.model = K3LitModule(model_cfg, self._value(self.config_init, "optim"),
                                 compile=self._value(self.config_init, "compile"),
                                 compile_mode=self._value(self.config_init, "compile_mode"),
                                 compile_scope=self._value(self.config_init, "compile_scope", "sublayers"),
                                 empty_init=isinstance(self.trainer.strategy, ModelParallelStrategy),
                                 init_weights=init_weights)
        ages["model"] = process_age_s()
        for cb in self.trainer.callbacks:
            if isinstance(cb, RunSummary):
                for mark, age in ages.items():
                    cb.record_age(mark, age)

    def _parse_ckpt_path(self) -> None:
        """Off: LightningCLI's would replace the whole recipe ``model`` with the checkpoint's, for a file path only,
        and silently; :meth:`_checkpoint_architecture` does it per field, for ``last`` as well, with a warning.
        (A private hook of LightningCLI: see :mod:`k3lit.lightning_compat`.)"""

    def _resolve_ckpt_path(self) -> str | None:
        """The checkpoint ``--ckpt_path`` names, as a file or sharded folder: ``last`` and ``hpc`` become the path
        Lightning would pick (None when there is none yet: the run starts from scratch), and the resolved path is
        what the sub-command loads; ``fit`` first finishes a save it was killed in (:meth:`_settle_checkpoints`).
        Raises FileNotFoundError for a path that is no checkpoint, CheckpointError for one that cannot be read
        (:func:`~k3lit.train.checkpoint.check_checkpoint`)."""
        ckpt_path = self._value(self.config_init, "ckpt_path")
        if self.subcommand == "fit":
            self._settle_checkpoints(ckpt_path)
        if ckpt_path in ("last", "hpc"):
            fn, asked = TrainerFn(self.subcommand), ckpt_path
            with warnings.catch_warnings():  # Lightning's hint (set save_last=True) does not apply: k3lit does
                warnings.filterwarnings("ignore", message=r".*there is no last checkpoint available")
                ckpt_path = compat.resolve_ckpt_path(self.trainer, fn, ckpt_path)
            if ckpt_path is None and asked == "last":
                where = " or ".join(str(cb.dirpath) for cb in self.trainer.checkpoint_callbacks if cb.dirpath)
                if self.subcommand in SCORING:
                    raise FileNotFoundError(f"--ckpt_path last: no last.ckpt in {where or 'the run folder'} to "
                                            f"{self.subcommand}; give a checkpoint file or sharded folder")
                init = self._value(self.config_init, "init_weights")
                rank_zero_warn(f"--ckpt_path last: no last.ckpt in {where or 'the run folder'} yet; "
                               + (f"this run starts from the weights of {init}" if init else
                                  "this run starts from scratch"))
            self.config_init[self.subcommand]["ckpt_path"] = ckpt_path
        return None if ckpt_path is None else str(check_checkpoint(ckpt_path))

    def _settle_checkpoints(self, ckpt_path: str | None) -> None:
        """Finish any checkpoint save that an earlier ``fit`` in this run folder was killed in (the folders where
        ``last`` and ``hpc`` look, and ``ckpt_path``), so that it resumes from, or moves aside, a whole checkpoint
        (:func:`~k3lit.train.checkpoint_save.settle`)."""
        folders = [cb.dirpath for cb in self.trainer.checkpoint_callbacks] + [self.trainer.default_root_dir]
        for folder in folders:
            if folder and is_local_path(folder):
                settle_folder(folder)
        if ckpt_path not in (None, "last", "hpc") and is_local_path(ckpt_path):
            settle(ckpt_path)

    def _align_with_checkpoint(self, ckpt_path: str) -> None:
        """Warn where this run and the checkpoint it loads disagree in a way that changes what the run does: ``fit``
        resumed at or past its ``max_steps`` or with its ``max_time`` spent (nothing is left to train), ``validate``
        on sequences of another length than the checkpoint trained on. A resumed ``fit`` reads the corpus in the file
        order its run was prepared in (``data.shuffle_documents``; sorted by path for a checkpoint that does not
        record it), so its saved data position points into the same chunks."""
        record = checkpoint_record(ckpt_path)
        self._check_tokenizer(ckpt_path, record, "--ckpt_path")
        data = record.get("datamodule_hyper_parameters") or {}
        shuffled = bool(data.get("shuffle_documents", False))
        if self.subcommand == "fit" and shuffled != self.datamodule.shuffle_documents:
            rank_zero_info(f"k3lit: --ckpt_path {ckpt_path} was trained on the corpus prepared with "
                           f"shuffle_documents={shuffled}; this run continues in that order")
            self.datamodule.shuffle_documents = shuffled
            self.datamodule.hparams["shuffle_documents"] = shuffled  # what this run's checkpoints record
        step, max_steps = record.get("global_step"), self.trainer.max_steps
        if self.subcommand == "fit" and isinstance(step, int) and 0 <= max_steps <= step:
            rank_zero_warn(f"--ckpt_path {ckpt_path} is at step {step} and trainer.max_steps={max_steps}: nothing is "
                           "left to train; raise --trainer.max_steps to continue")
        max_time = self._value(self.config_init, "trainer", default={}).get("max_time")
        elapsed = ((record.get("callbacks") or {}).get("Timer") or {}).get("time_elapsed", {}).get("train")
        if self.subcommand == "fit" and max_time is not None and elapsed is not None \
                and compat.time_interval_seconds(max_time) <= elapsed:
            rank_zero_warn(f"--ckpt_path {ckpt_path} has trained for {timedelta(seconds=round(elapsed))} and "
                           f"trainer.max_time={max_time} counts the whole run: nothing is left to train; raise "
                           "--trainer.max_time (DD:HH:MM:SS) or set --trainer.max_time=null to continue")
        trained = data.get("seq_len")
        if self.subcommand == "validate" and trained is not None and trained != self.datamodule.seq_len:
            rank_zero_warn(f"--ckpt_path {ckpt_path} trained on sequences of {trained} tokens; this validation reads "
                           f"{self.datamodule.seq_len} (--data.seq_len={trained} reads what it trained on)")

    def _init_weights(self, ckpt_path: str | None) -> str | None:
        """The checkpoint ``--init_weights`` names, checked whole (:func:`check_checkpoint`); None without the flag,
        and when ``ckpt_path`` resumes a run: its checkpoint holds the weights training has reached since (a
        requeued job keeps its command line). Raises ValueError outside ``fit``."""
        path = self._value(self.config_init, "init_weights")
        if path is None:
            return None
        if self.subcommand not in (None, "fit"):  # None: built with run=False, for the caller's trainer.fit
            raise ValueError(f"--init_weights is for fit; {self.subcommand} takes the weights of --ckpt_path")
        if ckpt_path is not None:
            rank_zero_info(f"k3lit: resuming from {ckpt_path}; --init_weights {path} is not read")
            return None
        if path in ("last", "hpc"):
            raise ValueError(f"--init_weights takes a checkpoint file or sharded folder; '{path}' is for --ckpt_path "
                             "(resuming this run folder's own checkpoint)")
        try:
            path = str(check_checkpoint(path))
        except FileNotFoundError as e:
            raise FileNotFoundError(f"--init_weights: {e}") from None
        for cb in self.trainer.checkpoint_callbacks:  # a new run moves its folder's last.ckpt aside before loading
            own = Path(cb.dirpath or "") / (cb.CHECKPOINT_NAME_LAST + cb.FILE_EXTENSION)
            if isinstance(cb, LastCheckpoint) and Path(path).resolve() == own.resolve():
                raise ValueError(f"--init_weights {path} is this run folder's own last.ckpt, which a new run moves "
                                 "aside; start the new run in another folder (--trainer.default_root_dir=...), or "
                                 "resume this one with --ckpt_path last")
        # the specs now; a trained BPE's vocabulary once the corpus is prepared (K3LitModule.configure_model)
        self._check_tokenizer(path, checkpoint_record(path), "--init_weights")
        return path

    def _check_tokenizer(self, path: str, record: dict, flag: str) -> None:
        """Raise :func:`tokenizer_error` when the checkpoint ``path`` (``record``: :func:`checkpoint_record`) names
        another tokenizer spec than this run's data, before any weight is read. A tokenizer file, named by its path,
        is not compared here; ``--init_weights`` compares its content when it loads
        (:func:`k3lit.train.checkpoint.load_initial_weights`)."""
        saved, ours = (record.get("K3DataModule") or {}).get("tokenizer_spec"), self.datamodule.tokenizer_spec
        if saved is not None and saved != ours and "file" not in {parse_tokenizer_spec(s)[0] for s in (saved, ours)}:
            raise tokenizer_error(path, record, ours, flag)

    def _checkpoint_architecture(self, ckpt_path: str, model_cfg: ModelConfig,
                                 flag: str = "--ckpt_path") -> ModelConfig:
        """``model_cfg`` with every field that shapes the weights taken from the checkpoint, so they always load
        into the architecture that wrote them; the :data:`~k3lit.model.RUNTIME_FIELDS` (activation checkpointing,
        KDA backend, balancer rates, capacity) and the whole ``optim`` section stay as this run sets them. Warns
        with each recipe or command-line value the checkpoint replaced; the saved config.yaml shows the result."""
        saved = checkpoint_hparams(ckpt_path).get("model")
        if not isinstance(saved, ModelConfig):
            return model_cfg
        values = vars(saved)
        kept = {f.name: values.get(f.name, f.default) for f in dataclasses.fields(ModelConfig)
                if f.name not in RUNTIME_FIELDS}
        replaced = [f"model.{k}={getattr(model_cfg, k)!r} (checkpoint: {v!r})" for k, v in kept.items()
                    if getattr(model_cfg, k) is not None and getattr(model_cfg, k) != v]
        if replaced:
            rank_zero_warn(f"{flag} {ckpt_path}: the checkpoint's architecture replaces " + ", ".join(replaced)
                           + f"; only {', '.join(RUNTIME_FIELDS)} and optim.* can differ from the checkpoint")
        model_cfg = dataclasses.replace(model_cfg, **kept)
        section = self.config[self.subcommand] if self.subcommand else self.config
        for k, v in kept.items():  # the config.yaml saved beside the run records what was used
            section[f"model.{k}"] = v
        return model_cfg

    def _trainer_kwargs(self) -> dict:
        """What k3lit adds to the configured trainer: the validation interval in optimizer steps (see the module
        docstring); unless configured, TensorBoard + CSV loggers, a last.ckpt checkpoint and the MoE heatmap every
        ``val_check_interval`` steps under default_root_dir, the throughput monitor, SLURM requeue, the end-of-run
        summary and a progress display. A run that loads a checkpoint continues the folder's ``metrics.csv`` and
        ``last.ckpt`` (:meth:`instantiate_classes`). ``validate``, ``test`` and ``predict`` of a checkpoint inside
        default_root_dir (``--ckpt_path last``, or a path there) log to ``<default_root_dir>/<sub-command>``, so that
        the training run's ``config.yaml``, ``metrics.csv`` and events stay as training left them."""
        cfg = self._value(self.config_init, "trainer", default={})
        root = Path(cfg.get("default_root_dir") or "runs/default")
        ckpt = self._value(self.config_init, "ckpt_path")
        own = ckpt in ("last", "hpc") or (ckpt is not None and is_local_path(ckpt)
                                          and Path(ckpt).resolve().is_relative_to(root.resolve()))
        logs = root / str(self.subcommand) if self.subcommand in SCORING and own else root
        out: dict = {}
        every = cfg.get("val_check_interval")
        steps = isinstance(every, int) and not isinstance(every, bool)
        if cfg.get("check_val_every_n_epoch") is None:
            if steps:  # Lightning counts training batches: one optimizer step is accumulate_grad_batches of them
                out["val_check_interval"] = every * (cfg.get("accumulate_grad_batches") or 1)
            elif every is None or isinstance(every, float):  # a fraction of an epoch (or once per epoch)
                out["check_val_every_n_epoch"] = 1
        seconds = compat.time_interval_seconds(every) if isinstance(every, (str, dict, timedelta)) else None
        every = every if steps and every > 0 else DEFAULT_EVERY_N_STEPS
        if cfg.get("logger") in (None, True):
            out["logger"] = [
                RunTensorBoardLogger(logs),  # append: set in instantiate_classes, once the checkpoint is resolved
                RunCSVLogger(logs),
            ]
        callbacks = list(cfg.get("callbacks") or [])
        if not any(isinstance(c, ModelCheckpoint) for c in callbacks):  # and when training ends
            callbacks.append(LastCheckpoint(root / "checkpoints", every_n_train_steps=None if seconds else every,
                                            train_time_interval=timedelta(seconds=seconds) if seconds else None))
        if not any(isinstance(c, ExpertLoadPlots) for c in callbacks):  # writes nothing for a model without MoE
            callbacks.append(ExpertLoadPlots(None if seconds else every))  # None: at each validation
        for kind in (K3ThroughputMonitor, SlurmRequeue, RunSummary, KernelPrecompile, GarbageCollection):
            if not any(isinstance(c, kind) for c in callbacks):
                callbacks.append(kind())
        if cfg.get("enable_progress_bar", True) is not False and not any(isinstance(c, ProgressBar) for c in callbacks):
            # a live bar on a terminal; plain lines in a log file (SLURM jobs, redirected output); after the
            # throughput monitor: its tok/s
            callbacks.append(StepProgressBar() if sys.stdout.isatty() else ProgressLines())
        out["callbacks"] = callbacks
        return out


def prepare_main(argv: list[str]) -> None:
    """``k3lit prepare``: build (or reuse) the tokenised litdata cache of a recipe's ``data`` section."""
    parser = ArgumentParser(prog="k3lit prepare", description=prepare_main.__doc__, allow_abbrev=False)
    parser.add_argument("--config", action=ActionConfigFile)
    parser.add_class_arguments(K3DataModule, "data")
    for group in ("model", "optim", "trainer"):
        parser.add_argument(f"--{group}", type=dict, default={}, help="ignored (recipes carry it for fit)")
    for key in ("seed_everything", "compile", "compile_mode", "compile_scope", "init_weights",
                "float32_matmul_precision"):
        parser.add_argument(f"--{key}", type=int | bool | str | None, default=None, help="ignored (used by fit)")
    cfg = _instantiate(parser, parser.parse_args(argv))
    dm: K3DataModule = cfg.data
    dm.prepare_data()
    print(dm.describe())


def _add_reach_arguments(parser: ArgumentParser) -> None:
    """``--attn_window`` and ``--attn_logn_base``: how the softmax-attention layers read a sequence longer than the
    training length (:class:`~k3lit.model.ModelConfig`'s ``attn_window`` and ``attn_logn_base``)."""
    parser.add_argument("--attn_window", type=int | None, default=None,
                        help="the softmax-attention layers attend to the last N tokens only (model.attn_window; "
                             "e.g. the training seq_len); default: the checkpoint's setting")
    parser.add_argument("--attn_logn_base", type=int | None, default=None,
                        help="log-n scaling of the softmax-attention queries beyond N positions "
                             "(model.attn_logn_base; e.g. the training seq_len); default: the checkpoint's setting")


def _reach(args: Any) -> dict[str, int]:
    """The :func:`_add_reach_arguments` given on the command line, as model fields."""
    return {k: getattr(args, k) for k in ("attn_window", "attn_logn_base") if getattr(args, k) is not None}


def _checkpoint_model(ckpt: dict, **runtime: Any) -> K3LM:
    """The K3LM of a loaded checkpoint (:func:`load_model_checkpoint`) on the CPU in eval mode, with ``runtime``
    :data:`~k3lit.model.RUNTIME_FIELDS` of its config replaced (e.g. ``activation_checkpointing="none"``)."""
    init = compat.init_args(ckpt["hyper_parameters"])
    if runtime:
        init["model"] = dataclasses.replace(init["model"], **runtime)
    module = K3LitModule(**init)
    module.load_state_dict(ckpt["state_dict"])
    return module.model.eval()


def generate_main(argv: list[str]) -> None:
    """``k3lit generate``: sample text from a checkpoint (prefill, then recurrent-state decoding)."""
    parser = ArgumentParser(prog="k3lit generate", description=generate_main.__doc__, allow_abbrev=False)
    parser.add_argument("--ckpt", type=str, required=True,
                        help="a .ckpt file or a sharded checkpoint folder (FSDP2 / expert-parallel runs) of k3lit fit")
    parser.add_argument("--prompt", type=str | None, default=None,
                        help="the text to continue (default 'def '); empty: a new document (the end-of-document "
                             "token alone)")
    parser.add_argument("--prompt_file", type=str | None, default=None,
                        help="read the prompt from this text file instead of --prompt")
    parser.add_argument("--prompt_tokens", type=int | None, default=None,
                        help="keep the prompt's first N tokens (a long-context prompt of an exact length)")
    parser.add_argument("--stats", type=bool, default=False,
                        help="print prompt length, prefill and decoding speed and peak device memory to stderr")
    parser.add_argument("--max_new_tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.8, help=">= 0; 0 = greedy")
    parser.add_argument("--top_k", type=int | None, default=50, help=">= 1, or null to keep every token")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", type=str, default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--precision", type=Literal["bf16-mixed", "32-true"] | None, default=None,
                        help="bf16-mixed: prefill and decoding under bf16 autocast (float32 weights and recurrent "
                             "state); default bf16-mixed on CUDA, else 32-true")
    parser.add_argument("--compile", type=bool, default=False,
                        help="compile the decoding step (torch.compile, the key/value cache length symbolic); its "
                             "first steps compile, which --stats' untimed pass takes out of the timing")
    _add_reach_arguments(parser)
    args = parser.parse_args(argv)
    check_sampling(args.max_new_tokens, args.temperature, args.top_k)  # before the (possibly long) checkpoint load
    if args.prompt is not None and args.prompt_file is not None:
        raise ValueError("give --prompt or --prompt_file, not both")
    if args.prompt_file is not None and not Path(args.prompt_file).is_file():
        raise FileNotFoundError(f"--prompt_file {args.prompt_file}: no such file")
    ckpt = load_model_checkpoint(args.ckpt)
    model = _checkpoint_model(ckpt, **_reach(args)).to(args.device)
    if K3DataModule.__qualname__ in ckpt:  # the tokenizer travels inside the checkpoint
        tok = tokenizer_from_state(ckpt[K3DataModule.__qualname__])
    else:
        tok = K3DataModule(**compat.init_args(ckpt["datamodule_hyper_parameters"])).tokenizer
    text = Path(args.prompt_file).read_text() if args.prompt_file else "def " if args.prompt is None else args.prompt
    ids = tok.encode(text) if text else [tok.eos_id]  # nothing: a new document, as after a document's end in training
    if not ids:
        raise ValueError("--prompt must encode to at least one token")
    if args.prompt_tokens is not None:
        if not 1 <= args.prompt_tokens <= len(ids):
            raise ValueError(f"--prompt_tokens={args.prompt_tokens}: the prompt has {len(ids)} tokens; give a number "
                             "from 1 to that, or a longer --prompt_file")
        ids = ids[: args.prompt_tokens]
    idx = torch.tensor([ids], dtype=torch.long, device=args.device)
    precision = args.precision or ("bf16-mixed" if idx.is_cuda else "32-true")
    autocast = torch.autocast(idx.device.type, dtype=torch.bfloat16, enabled=precision == "bf16-mixed")
    timings: dict[str, float] | None = {} if args.stats else None
    with autocast:
        if args.stats:  # untimed: the same prompt and three decoding steps compile every kernel (and, with
            # --compile, every graph: they settle by the second step) that the timed pass runs
            model.generate(idx, min(3, args.max_new_tokens), args.temperature, args.top_k,
                           torch.Generator(device=args.device).manual_seed(args.seed), compile_decode=args.compile)
        if args.stats and idx.is_cuda:
            torch.cuda.reset_peak_memory_stats(idx.device)
        gen = torch.Generator(device=args.device).manual_seed(args.seed)
        out = model.generate(idx, args.max_new_tokens, args.temperature, args.top_k, gen, timings=timings,
                             compile_decode=args.compile)
    print(tok.decode(out[0].tolist()))
    if timings is not None:
        peak = f"{torch.cuda.max_memory_allocated(idx.device) / 2**30:.2f} GiB" if idx.is_cuda else "n/a (CPU)"
        decode = args.max_new_tokens / timings["decode_s"] if timings["decode_s"] > 0 else float("nan")
        print(f"k3lit generate: prompt {len(ids):,} tokens, prefill {timings['prefill_s']:.2f} s "
              f"({len(ids) / timings['prefill_s']:,.0f} tokens/s); {args.max_new_tokens} new tokens in "
              f"{timings['decode_s']:.2f} s ({decode:,.1f} tokens/s); peak device memory {peak}; {precision}"
              f"{', decoding step compiled' if args.compile else ''}, after an untimed pass over the same prompt "
              "(kernel compilation excluded)", file=sys.stderr)


def positions_main(argv: list[str]) -> None:
    """``k3lit positions``: held-out bits per byte by position bucket at several sequence lengths, up to and beyond
    the checkpoint's training length (see :mod:`k3lit.train.positions`)."""
    from k3lit.train import positions as pos

    parser = ArgumentParser(prog="k3lit positions", description=positions_main.__doc__, allow_abbrev=False)
    parser.add_argument("--ckpt", type=str, required=True,
                        help="a .ckpt file or a sharded checkpoint folder (FSDP2 / expert-parallel runs) of k3lit fit")
    parser.add_argument("--lengths", type=int, nargs="+", default=None,
                        help="evaluation lengths in tokens, e.g. 2048 8192 32768; default: 1, 4 and 16 times the "
                             "checkpoint's data.seq_len")
    parser.add_argument("--blocks", type=int, default=8,
                        help="held-out blocks per length, the first in file order (fewer if the split holds fewer)")
    parser.add_argument("--bucket_base", type=int | None, default=None,
                        help="first bucket edge B: buckets [0,B), [B,2B), [2B,4B), ...; default the training seq_len")
    parser.add_argument("--window", type=int | None, default=None,
                        help="also read every block in windows of this many tokens, each from an empty state, to "
                             "score the same bytes without the longer context; default the training seq_len")
    _add_reach_arguments(parser)
    for key, kind in (("corpus", str | list[str] | None), ("tokenizer", str | None), ("cache_dir", str | None),
                      ("val_fraction", float | None)):
        parser.add_argument(f"--data.{key}", type=kind, default=None, help=f"default: the checkpoint's data.{key}")
    parser.add_argument("--device", type=str, default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--precision", type=Literal["bf16-mixed", "32-true"] | None, default=None,
                        help="bf16-mixed: the forward under bf16 autocast; default bf16-mixed on CUDA, else 32-true")
    parser.add_argument("--json", type=str | None, default=None, help="write the results to this JSON file")
    parser.add_argument("--png", type=str | None, default=None, help="draw bpb against position bucket into this PNG")
    args = parser.parse_args(argv)
    if args.blocks < 1 or any(n < 1 for n in args.lengths or []) or (args.window is not None and args.window < 1):
        raise ValueError(f"--blocks {args.blocks} --lengths {args.lengths} --window {args.window}: each must be >= 1")
    ckpt = load_model_checkpoint(args.ckpt)
    data = {**compat.init_args(ckpt.get("datamodule_hyper_parameters", {})),
            **{k: v for k, v in vars(args.data).items() if v is not None}}
    train_len = data.get("seq_len")
    if train_len is None and (args.lengths is None or args.bucket_base is None):
        raise ValueError(f"{args.ckpt} records no data.seq_len: pass --lengths and --bucket_base")
    lengths = args.lengths or [train_len, 4 * train_len, 16 * train_len]
    base = args.bucket_base or train_len
    if min(lengths) < base:  # its blocks would fill only part of the first bucket, which the table names 0-base
        raise ValueError(f"--lengths {min(lengths)} is shorter than the first position bucket (0-{base}: "
                         f"{'--bucket_base' if args.bucket_base else 'the training length, --bucket_base by default'}):"
                         f" pass lengths of at least {base}, or --bucket_base {min(lengths)}")
    edges = pos.bucket_edges(max(lengths), base)
    prepared = K3DataModule(**data).prepared
    pos.check_same_tokenizer(prepared.tokenizer, ckpt.get(K3DataModule.__qualname__))
    device = torch.device(args.device)
    model = _checkpoint_model(ckpt, activation_checkpointing="none", checkpoint_blocks=None, **_reach(args))
    model = model.to(device)
    byte_table = torch.from_numpy(prepared.tokenizer.token_bytes()).to(device)
    bf16 = (args.precision or ("bf16-mixed" if device.type == "cuda" else "32-true")) == "bf16-mixed"
    results = []
    for length in lengths:
        count, blocks = pos.held_out_blocks(prepared, length, args.blocks)
        if count < args.blocks:
            print(f"length {length:,}: the held-out split holds {count} blocks of {length + 1:,} tokens; using {count}")
        results.append(pos.evaluate_length(model, blocks, byte_table, edges, torch.bfloat16 if bf16 else None,
                                           window=args.window or train_len))
    c = model.config
    mixers, run = ("KDA state and attention", "run") if "K" in c.layer_pattern else ("attention", "runs")
    across = (f"each document restarts {mixers} (document_masking)" if c.document_masking
              else f"{mixers} {run} across document boundaries within a block")
    reach = (f"; softmax attention over the last {c.attn_window} tokens" if c.attn_window else "") + (
        f"; queries scaled by log-n beyond {c.attn_logn_base} positions" if c.attn_logn_base else "")
    print(f"held-out bits per byte by position bucket: {args.ckpt} (trained at seq_len {train_len}) on "
          f"{prepared.root / 'val'}\n(packed documents joined by eos, read as blocks of length + 1 tokens in file "
          f"order; {across}, as in training{reach}; 'in W': the same bytes read in windows of W tokens, each from "
          "an empty state)")
    print(pos.format_table(results))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"checkpoint": str(args.ckpt), "train_seq_len": train_len,
                                               "edges": edges, "split": str(prepared.root / "val"),
                                               "precision": "bf16-mixed" if bf16 else "32-true",
                                               "attn_window": c.attn_window, "attn_logn_base": c.attn_logn_base,
                                               "results": results}, indent=1) + "\n")
        print(f"wrote {args.json}")
    if args.png:
        pos.plot_positions(results, f"{Path(args.ckpt).name}: trained at {train_len} tokens", Path(args.png))
        print(f"wrote {args.png}")


def export_main(argv: list[str]) -> None:
    """``k3lit export``: write a checkpoint as a Hugging Face folder that ``transformers.AutoModelForCausalLM
    .from_pretrained(DIR, trust_remote_code=True)`` loads (k3lit's torch path; k3lit must be installed there)."""
    from k3lit.export import export_hf

    parser = ArgumentParser(prog="k3lit export", description=export_main.__doc__, allow_abbrev=False)
    parser.add_argument("--ckpt", type=str, required=True,
                        help="a .ckpt file or a sharded checkpoint folder (FSDP2 / expert-parallel runs) of k3lit fit")
    parser.add_argument("--out", type=str, required=True, help="the folder to write")
    args = parser.parse_args(argv)
    print(f"wrote {export_hf(args.ckpt, args.out)}")


EXTRA_COMMANDS = """k3lit commands besides Lightning's (fit, validate, test, predict, below):
  k3lit prepare --config RECIPE          tokenise the recipe's corpus into litdata chunks
  k3lit generate --ckpt CKPT --prompt S  sample from a checkpoint (file or distributed-checkpoint folder)
  k3lit export --ckpt CKPT --out DIR     a Hugging Face folder (AutoModelForCausalLM, trust_remote_code)
  k3lit positions --ckpt CKPT            held-out bits per byte by position, at and beyond the training length
  k3lit slurm --config RECIPE --nodes N --gpus_per_node G ...   render an sbatch script
Each takes --help.
"""


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``k3lit`` console script."""
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):  # LightningCLI's help lists only its own sub-commands
        print(EXTRA_COMMANDS)
    try:
        if args and args[0] == "prepare":
            return prepare_main(args[1:])
        if args and args[0] == "generate":
            return generate_main(args[1:])
        if args and args[0] == "export":
            return export_main(args[1:])
        if args and args[0] == "positions":
            return positions_main(args[1:])
        if args and args[0] == "slurm":
            from k3lit.slurm import slurm_main

            return slurm_main(args[1:])
        K3CLI(args=argv)
    except CheckpointError as e:  # one line: the file and what is wrong with it
        if os.environ.get("K3LIT_DEBUG"):
            raise
        print(f"k3lit: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except (ValueError, FileNotFoundError, MisconfigurationException) as e:  # configuration errors: say what to
        # change, no traceback
        if os.environ.get("K3LIT_DEBUG"):
            raise
        print(f"k3lit: error: {e}\n(set K3LIT_DEBUG=1 for the traceback)", file=sys.stderr)
        raise SystemExit(2) from None


def console_main() -> None:
    """The ``k3lit`` command (and ``python -m k3lit.cli``): :func:`main` in a process of its own, which then ends
    through :func:`~k3lit.parallel.process_exit.exit_process`, without interpreter finalisation: after a run, torch's
    C++ threads (gloo's, the autograd engine's) are still alive, and finalising with them can abort a process whose
    work succeeded. Errors (a traceback, ``SystemExit``) leave the usual way. Warnings print as one line each
    (where, category, message), without the echo of the source line that raised them."""
    default_format = warnings.formatwarning
    warnings.formatwarning = _one_line_warning
    try:
        main()
    finally:  # interpreter finalisation, after an error, formats as Python does
        warnings.formatwarning = default_format
    exit_process(0)


def _one_line_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                      line: str | None = None) -> str:
    return f"{filename}:{lineno}: {category.__name__}: {message}\n"


if __name__ == "__main__":
    console_main()
