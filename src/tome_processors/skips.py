"""One place that says where an attention ToMe was asked to merge in runs on all its tokens, and why.

Every such path calls `report_skip` with a `Skip`. A cause the user did not choose (an attention mask, tokens
that form no grid, rotary tables of an unknown shape, ...) warns once per model and cause, naming the attention
module and the cause. A cause the user chose (the pays rule of a preset, a merge flag off, a level left out,
ratio 0) is logged at DEBUG, once. Under `strict_skips()` (or with the environment variable
`TOME_PROCESSORS_STRICT=1`) a cause the user did not choose raises `ToMeSkipError` instead, at every call.

The merging path does not come here. On the skip path, after the first report, a call costs one set lookup.
Nothing is reported while torch.compile traces (a warning would break the graph).
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
import logging
import os
import warnings
from collections.abc import Iterator
from typing import Any

from ._similarity import is_compiling

__all__ = ["Skip", "SkipLog", "ToMeSkipError", "ToMeSkipWarning", "report_skip", "strict_skips"]

logger = logging.getLogger(__name__)


class ToMeSkipWarning(UserWarning):
    """An attention that ToMe was asked to merge in ran unmerged, for a cause the user did not choose."""


class ToMeSkipError(RuntimeError):
    """What `ToMeSkipWarning` becomes under `strict_skips()`."""


class Skip(enum.Enum):
    """Why an attention ToMe was asked to merge in runs on all its tokens.

    Each member has `cause` (what the attention got, as the end of "but got ...") and `chosen` (whether the
    user's configuration asked for it: such causes are logged, not warned about).

    Example:
        >>> Skip.MASK.chosen, Skip.PAYS.chosen
        (False, True)
    """

    NOT_TOKENS = ("hidden states that are not (batch, tokens, channels)", False)
    MASK = ("an attention mask, which would no longer line up with merged tokens", False)
    NO_BLOCK_INPUT = ("no input of its block in this forward (the block's pre-hook did not run)", False)
    NO_GRID = ("tokens that form no grid of the model's latent at any downsample level", False)
    NO_MODEL_GRID = ("a model call whose inputs give no token grid (the latent's size or the image ids)", False)
    SHAPE = (
        "another batch and token count than its block's, that form no whole sub-grids of the block's grid",
        False,
    )
    SMALL_GRID = ("a token grid with no whole sy x sx window of the configuration", False)
    FEW_FRAMES = ("fewer frames than st, the frames of one merge window", False)
    TEXT_IN_SELF = ("encoder_hidden_states in a self-attention, whose keys K/V pooling would replace", False)
    FEWER_TOKENS = ("fewer tokens than its block's grid holds", False)
    ROTARY = ("rotary tables of a shape ToMe does not know, or that do not cover the merged sequence", False)
    SHARD = ("a shard of the tokens under context parallelism that forms no grid of whole rows", False)
    SHARD_FRAMES = (
        "a context-parallel shard counted in frames from mid-frame, which merges across frames (st > 1) only, under "
        "a configuration that merges frame by frame (st=1) where the model's merges across frames",
        False,
    )
    KV_JOINT = ("joint attention, which K/V pooling (mode='downsample_kv') cannot reach", False)
    REPLACED = ("processors that replaced every ToMe processor of the model, so ToMe stood down", False)
    # Chosen by the configuration: logged, not warned about.
    PAYS = ("the pays rule (pays_only), which turns merging off where it would not save time", True)
    FLAG_OFF = ("merge_attn / merge_crossattn off for this kind of attention", True)
    LEVEL_OFF = ("a downsample level the configuration leaves out (max_downsample, level_ratios)", True)
    NOTHING_TO_MERGE = ("a ratio that merges no token here (ratio 0, ratio_start, or too few tokens)", True)
    KV_CROSS = ("cross-attention, which K/V pooling (mode='downsample_kv') leaves whole", True)

    def __init__(self, cause: str, chosen: bool) -> None:
        self.cause = cause
        self.chosen = chosen


class SkipLog:
    """The causes already reported for one model (`ModelState.skips`), and the model's name for the messages."""

    __slots__ = ("model_name", "reported")

    def __init__(self, model_name: str = "") -> None:
        self.model_name = model_name
        self.reported: set[Skip] = set()


#: Whether a cause the user did not choose raises (`strict_skips`); the environment gives the default.
_STRICT: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "tome_strict_skips", default=os.environ.get("TOME_PROCESSORS_STRICT", "") not in ("", "0")
)


@contextlib.contextmanager
def strict_skips(enabled: bool = True) -> Iterator[None]:
    """Inside, an attention ToMe was asked to merge in that runs unmerged for a cause the user did not choose
    raises `ToMeSkipError` (at every call, not once) instead of warning once.

    Example:
        >>> import tome_processors as tp
        >>> with tp.strict_skips():  # doctest: +SKIP
        ...     pipe("a photo of a cat")
    """
    token = _STRICT.set(enabled)
    try:
        yield
    finally:
        _STRICT.reset(token)


def report_skip(log: SkipLog, reason: Skip, site: str = "", tokens: Any = None, message: str | None = None) -> None:
    """Say that `site` (an attention module's name) of the model `log` belongs to runs unmerged, for `reason`.

    Warns (`ToMeSkipWarning`) once per model and reason, or raises `ToMeSkipError` under `strict_skips()`;
    a reason the user chose is logged at DEBUG once. `tokens` (the hidden states the attention got) adds their
    shape to the message; `message` replaces the warning's text (and follows the error's).

    Example:
        >>> log = SkipLog("UNet2DConditionModel")
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     for _ in range(2):
        ...         report_skip(log, Skip.MASK, "down_blocks.0.attn1")
        >>> len(caught)
        1
    """
    if is_compiling():
        return
    if reason in log.reported and (reason.chosen or not _STRICT.get()):
        return
    _report(log, reason, site, tokens, message)


def _report(log: SkipLog, reason: Skip, site: str, tokens: Any, message: str | None) -> None:
    where = f"{log.model_name}.{site}" if site and log.model_name else site or log.model_name or "an attention"
    shape = getattr(tokens, "shape", None)
    got = f"{reason.cause} (hidden states of shape {tuple(shape)})" if shape is not None else reason.cause
    if reason.chosen:
        log.reported.add(reason)
        logger.debug("ToMe merges nothing in %s: %s, as configured.", where, got)
        return
    if _STRICT.get():
        extra = f" {message}" if message else ""
        raise ToMeSkipError(f"Expected ToMe to merge the tokens of {where}, but got {got}.{extra}")
    log.reported.add(reason)
    warnings.warn(
        message or f"ToMe merges nothing in {where}: it got {got}. (Said once per model and cause.)",
        ToMeSkipWarning,
        stacklevel=4,
    )
