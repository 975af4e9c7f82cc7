"""Token Merging (ToMe) for Stable Diffusion as composable diffusers attention processors.

Example:
    >>> import tome_processors
    >>> tome_processors.apply_tome(pipe, ratio=0.5)  # doctest: +SKIP
    >>> pipe.unet.set_attn_processor(tome_processors.ToMeProcessor(ratio=0.5))  # doctest: +SKIP
"""

from .apply import apply_tome, is_tome_applied, new_generation, remove_tome
from .config import ToMeConfig
from .explain import SiteExplanation, explain_tome
from .families import Family, Layout, Rotary, Span, Stack, register_family, unregister_family
from .hooks import set_timestep_schedule, set_token_grid
from .pipeline import ToMeMixin, disable_tome, enable_tome, patch_pipelines, unpatch_pipelines
from .processor import ToMeProcessor
from .skips import ToMeSkipError, ToMeSkipWarning, strict_skips

__version__ = "0.1.0"

__all__ = [
    "Family",
    "Layout",
    "Rotary",
    "Span",
    "Stack",
    "ToMeConfig",
    "ToMeMixin",
    "SiteExplanation",
    "ToMeProcessor",
    "ToMeSkipError",
    "ToMeSkipWarning",
    "__version__",
    "apply_tome",
    "disable_tome",
    "enable_tome",
    "explain_tome",
    "is_tome_applied",
    "new_generation",
    "patch_pipelines",
    "register_family",
    "remove_tome",
    "set_timestep_schedule",
    "set_token_grid",
    "strict_skips",
    "unpatch_pipelines",
    "unregister_family",
]
