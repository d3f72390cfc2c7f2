"""Whether a training run compiles its encoder: the ``compile`` key resolved (true, false, or null = auto).

``auto`` compiles when the run is on the CPU, its encoder is not packed (``encoder.packed``), trains with
``prompt_dropout > 0`` and is long enough for the compiled steps to pay back the compilation: its estimated
matrix work (:func:`estimated_run_flops`) is at least :data:`AUTO_MIN_RUN_FLOPS`. Otherwise the encoder runs
eagerly: on GPUs compile has not been measured; a packed encoder gains more from packing than a compiled one did,
and would recompile for every new length; without prompt dropout the eager step (C++ attention kernel, prefix read
in place) was as fast as the compiled one (within 3%, slower compiled); short runs such as the test suite's lose
more to compilation than they gain. Prompt dropout
draws a per-example copy of every layer's prefix, elementwise work Inductor fuses: there a compiled step saved
16-22%. The measurements are in docs/speed.md ("Compile default").

:func:`compile_encoder` compiles it: the forward traces whole, without a graph break (a test keeps it so), and
Dynamo's recompile-limit warning is one line.

``cuda_graphs: true`` (:func:`check_cuda_graphs`, :func:`graph_widths`, :func:`eager_outside_training`) compiles it
with ``mode="reduce-overhead"``: Inductor replays each training forward and backward as a CUDA graph, one launch
instead of hundreds, which is what a launch-bound GPU step needs. A graph holds one set of shapes, so the batches are
padded to at most eight widths (the rows' count varies only for a last, smaller batch; one compilation with dynamic
shapes, a graph recorded per shape); the host path reads nothing back (fastprompt.host_sync), the
dropout seeds are drawn on the device, and the evaluations run the encoder eagerly (their widths vary per batch).
"""
from __future__ import annotations

import contextlib
import logging

from .flops import step_flops

logger = logging.getLogger(__name__)

#: Matrix work of a run (floating-point operations) from which ``compile: null`` compiles on a CPU: 2-4x the
#: break-even measured on 2 cores (with prompt dropout 0.1, a compiled MiniLM step saves ~1.5e-12 s per FLOP
#: against the eager step with the C++ attention kernel; a run compiles 3-4 graphs, train and evaluation, static
#: then dynamic shapes, ~40-90 s each: 1e14-2.4e14 FLOP to pay back). MiniLM at 64 pairs x 32 tokens: ~2900
#: steps; BERT-base: ~400.
AUTO_MIN_RUN_FLOPS = 5e14


def estimated_run_flops(config, backbone_config, steps: int, views: int = 2) -> float:
    """The matrix work of ``steps`` steps of a run (:func:`fastprompt.train.flops.step_flops`): ``batch_size *
    views`` sequences of ``max_length`` tokens each (an upper bound on the padded length; ``views`` = 2, the fewest
    a contrastive method embeds)."""
    step = step_flops(backbone_config, config.max_length, config.prompt_length, rows=config.batch_size * views,
                      train_backbone=config.train_backbone)
    return step.total * max(int(steps), 0)


def resolve_compile(config, encoder, device, steps: int, packed: bool = False) -> bool:
    """Whether to ``torch.compile`` the encoder for a run of ``steps`` optimisation steps (its total, so that a
    resumed run decides as the uninterrupted one did) on ``device``; ``packed``: the encoder runs packed batches."""
    setting = config.run.compile
    if config.run.cuda_graphs:  # the graphs are torch.compile's (check_cuda_graphs refused compile: false)
        return True
    if setting is not None:
        return bool(setting)
    if getattr(device, "type", str(device)) != "cpu":
        return False
    if packed:  # packing saved more than compiling did (docs/speed.md), and every new length would recompile
        logger.info("compile: null (auto) -> eager: the encoder runs packed batches")
        return False
    if config.prompt_dropout == 0:
        logger.info("compile: null (auto) -> eager: without prompt dropout a compiled CPU step is no faster")
        return False
    work = estimated_run_flops(config, encoder.backbone.config, steps)
    on = work >= AUTO_MIN_RUN_FLOPS
    logger.info("compile: null (auto) -> %s: %d steps, ~%.2g FLOP of matrix work (compiles from %.2g)",
                "compiling the encoder" if on else "eager", steps, work, AUTO_MIN_RUN_FLOPS)
    return on


def compile_encoder(encoder, cuda_graphs: bool = False) -> None:
    """``torch.compile`` the encoder in place (parameter names, checkpoints and the module stay), with what its
    graphs read prepared beforehand: the C++ kernels' extension imported once (the fused ops import it on first
    use, and an import inside the traced forward broke the graph at every fused op). Dynamo's multi-line warning
    that a function reached its recompile limit becomes one line (:class:`OneLineRecompileLimit`).
    ``cuda_graphs``: Inductor's CUDA graphs (``mode="reduce-overhead"``) around the compiled forward and backward."""
    from fastprompt.ops import _cpp

    _cpp.available()
    dynamo_log = logging.getLogger(DYNAMO_LOGGER)
    if not any(isinstance(f, OneLineRecompileLimit) for f in dynamo_log.filters):
        dynamo_log.addFilter(OneLineRecompileLimit())
    if cuda_graphs:
        # dynamic shapes from the first call: one compilation serves every width and row count (automatic dynamic
        # shapes would compile up to three times: static, then the width, then the rows dynamic)
        encoder.compile(mode="reduce-overhead", dynamic=True)
    else:
        encoder.compile()


#: The most padded widths a ``cuda_graphs`` run's batches take (a graph is recorded per width and row count).
MAX_GRAPH_WIDTHS = 8


def graph_widths(max_length: int) -> tuple[int, ...]:
    """The widths a ``cuda_graphs`` run pads its batches to: multiples of ``max(8, max_length / 8)`` tokens up to
    ``max_length`` (at most :data:`MAX_GRAPH_WIDTHS`, and max_length itself), so a batch carries at most an eighth
    of ``max_length`` more padding than its longest row needs (masked: the same maths). A batch wider than
    ``max_length`` (a template's tokens on top, PromptBERT) keeps its own width, a shape of its own."""
    step = max(8, -(-max_length // MAX_GRAPH_WIDTHS))
    return tuple(sorted({*range(step, max_length, step), max_length}))


def check_cuda_graphs(config, device) -> None:
    """Refuse ``cuda_graphs: true`` where it cannot apply, before the model loads: on any device but a GPU (what
    it captures are CUDA graphs); the settings that rule it out whatever the device are refused by the config
    itself (:meth:`fastprompt.train.config.TrainConfig.validate`: the gradient cache, packed batches, compile:
    false)."""
    if config.run.cuda_graphs and getattr(device, "type", str(device)) != "cuda":
        raise ValueError(f"cuda_graphs: true captures CUDA graphs and needs a CUDA device; this run is on "
                         f"{device} (device: {config.run.device}): set cuda_graphs: false, or run on a GPU")


def eager_outside_training(config):
    """A context in which a ``cuda_graphs`` run's compiled encoder runs eagerly: the evaluations and the collapse
    probe, whose batch widths vary (each would record a graph of its own); a no-op context otherwise."""
    if config.run.cuda_graphs:
        import torch

        return torch.compiler.set_stance("force_eager")
    return contextlib.nullcontext()


def mark_step(config) -> None:
    """Tell Inductor's CUDA graphs that a training step begins (their outputs of the last step may be reused)."""
    if config.run.cuda_graphs:
        import torch

        torch.compiler.cudagraph_mark_step_begin()


#: The logger of torch._dynamo's "hit config.recompile_limit" warning.
DYNAMO_LOGGER = "torch._dynamo.convert_frame"


class OneLineRecompileLimit(logging.Filter):
    """torch._dynamo's warning that a function hit its recompile limit (five lines and a link), in one line that
    says what it means in a fastprompt run: a packed encoder's forward takes the rows' host lengths, a list whose
    length Dynamo specialises, so each batch row count (the last, smaller batch of an evaluation) compiles a graph of
    its own; past the limit, inputs of further shapes run eagerly (the same results). Other records pass unchanged."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        if isinstance(record.msg, str) and record.msg.startswith("torch._dynamo hit config.") and len(args) >= 4:
            limit_type, limit, function, reason = args[:4]
            record.msg = ("torch.compile: %s reached config.%s (%s graphs; the last for %s): inputs of further "
                          "shapes run it eagerly (a packed encoder compiles a graph per batch row count); "
                          "TORCH_LOGS=recompiles lists each")
            record.args = (function, limit_type, limit, str(reason).split("#")[0].strip())
        return True
