"""The `multimodal` section of `areno train`: tower/projector training and the image caps (shared with serve)."""

# argparse-dataclass maps typing.Optional[X] to an X-typed flag, but not PEP 604 unions (X | None): keep Optional.
# ruff: noqa: UP007, UP045

from dataclasses import dataclass
from typing import Optional

from areno.config.constants import LR_STYLES
from areno.config.fields import (
    ConfigError,
    check_choice,
    check_media_limits,
    check_non_negative,
    check_sizes,
    flag_name,
    opt,
)

IMAGE_BYTES_HELP = ("largest encoded image accepted in a prompt, in bytes (a larger one is refused: exit 2 for a "
                    "dataset row, HTTP 400 for a request)")
IMAGE_PIXELS_HELP = "largest image accepted, in pixels (width x height, before the processor resizes it)"
IMAGES_HELP = "most images accepted in one prompt"

@dataclass
class MultimodalSection:
    """`--help` group multimodal (its checks read the optim section's --lr)."""

    unfreeze_mm_tower: bool = opt(False, "train the vision/audio tower as its own optimizer group with its own "
                             "schedule (--mm-tower-*; frozen unless given)", "multimodal")
    unfreeze_mm_projector: bool = opt(False, "train the projector/merger as its own optimizer group with its own "
                                 "schedule (--mm-projector-*; frozen unless given)", "multimodal")
    mm_tower_lr: Optional[float] = opt(None, "tower peak learning rate", "multimodal", default_help="--lr",
                                       needs="tower")
    mm_tower_min_lr: Optional[float] = opt(None, "tower final learning rate", "multimodal", default_help="--min-lr",
                                           needs="tower")
    mm_tower_lr_steps: Optional[int] = opt(None, "tower schedule length in optimizer updates (as --warmup-steps)",
                                           "multimodal", default_help="the run length", needs="tower")
    mm_tower_lr_style: Optional[str] = opt(None, "tower schedule", "multimodal", choices=LR_STYLES,
                                           default_help="--lr-decay-style", needs="tower")
    mm_projector_lr: Optional[float] = opt(None, "projector peak learning rate", "multimodal", default_help="--lr",
                                           needs="projector")
    mm_projector_min_lr: Optional[float] = opt(None, "projector final learning rate", "multimodal",
                                               default_help="--min-lr", needs="projector")
    mm_projector_lr_steps: Optional[int] = opt(None, "projector schedule length in optimizer updates (as "
                                               "--warmup-steps)", "multimodal", default_help="the run length",
                                               needs="projector")
    mm_projector_lr_style: Optional[str] = opt(None, "projector schedule", "multimodal", choices=LR_STYLES,
                                               default_help="--lr-decay-style", needs="projector")
    max_image_bytes: int = opt(20 << 20, IMAGE_BYTES_HELP, "multimodal")
    max_image_pixels: int = opt(50_000_000, IMAGE_PIXELS_HELP, "multimodal")
    max_images_per_prompt: int = opt(64, IMAGES_HELP, "multimodal")


    def check_multimodal(self):
        """A final rate may not exceed its peak (a tower/projector schedule flag needs its part unfrozen:
        areno.config.applies; whether the model has a tower at all is checked once it is loaded:
        areno.training.multimodal.check_flags)."""
        check_sizes(self, ("mm_tower_lr_steps", "mm_projector_lr_steps"))
        for part in ("tower", "projector"):
            check_choice(f"--mm-{part}-lr-style", getattr(self, f"mm_{part}_lr_style"), LR_STYLES, optional=True)
            for name in (f"mm_{part}_lr", f"mm_{part}_min_lr"):
                if getattr(self, name) is not None:
                    check_non_negative(flag_name(name), getattr(self, name))
        check_media_limits(self)
        for part in ("tower", "projector"):
            peak, low = getattr(self, f"mm_{part}_lr"), getattr(self, f"mm_{part}_min_lr")
            if low is not None and low > (self.lr if peak is None else peak):
                raise ConfigError(f"--mm-{part}-min-lr", f"({low}) must not exceed the {part}'s peak rate "
                                  f"{'--mm-' + part + '-lr' if peak is not None else '--lr'} "
                                  f"({self.lr if peak is None else peak})")
