"""The LoRA flags of ``trainer-ext train`` (``--lora_r`` …) and their checks, made before peft is imported."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

from trainer_ext.errors import ConfigError
from trainer_ext.job.fields import field_help

# LoRA from the command line: the defaults of TRL's CLI (alpha twice the rank, so the update's scale alpha/r stays 2
# whatever the rank; a little dropout), and what to install when peft is missing.
LORA_ALPHA_PER_RANK = 2
LORA_DROPOUT = 0.05
ALL_LINEAR = "all-linear"
PEFT_INSTALL = "pip install 'peft>=0.14'"


@dataclass
class LoraArguments:
    """LoRA adapters instead of full fine-tuning: ``get_peft_model(model, LoraConfig(...))`` built from flags."""

    lora_r: int = field(
        default=0,
        metadata=field_help(
            "Train LoRA adapters of this rank (e.g. 8) on a frozen model instead of every weight; 0 (default): "
            f"full fine-tuning. Needs peft ({PEFT_INSTALL}; from a checkout: pip install -e '.[peft]')."
        ),
    )
    lora_alpha: int | None = field(
        default=None,
        metadata=field_help(
            f"LoRA scaling: the adapter's update is multiplied by lora_alpha / lora_r. Default: {LORA_ALPHA_PER_RANK} "
            "* --lora_r."
        ),
    )
    lora_dropout: float | None = field(
        default=None, metadata=field_help(f"Dropout on the adapters' input, in [0, 1). Default: {LORA_DROPOUT}.")
    )
    lora_target_modules: None | str | list[str] = field(
        default=None,
        metadata=field_help(
            f"Modules that get adapters: comma-separated module names (e.g. q_proj,v_proj) or {ALL_LINEAR} (every "
            "linear layer but the output head). Default: peft's choice for the model type (the attention query and "
            "value projections)."
        ),
    )
    merge_lora: bool = field(
        default=False,
        metadata=field_help(
            "Also write the model with the adapters merged into its weights to <output_dir>/merged: a plain model "
            "that loads with AutoModelFor... and needs no peft. The adapter itself stays in --output_dir."
        ),
    )

    def validate_lora(self) -> None:
        """Check the LoRA flags and how they combine (before any peft import); raise ConfigError on bad input."""
        if self.lora_r < 0:
            raise ConfigError(
                f"--lora_r must be a rank of 1 or more (e.g. 8), or 0 for full fine-tuning; got {self.lora_r}"
            )
        if self.lora_r == 0:
            given = [
                f"--{name}"
                for name in ("lora_alpha", "lora_dropout", "lora_target_modules")
                if getattr(self, name) is not None
            ]
            given += ["--merge_lora"] if self.merge_lora else []
            if given:
                raise ConfigError(
                    f"{', '.join(given)} given without --lora_r: add --lora_r N (e.g. 8) to train LoRA adapters, or "
                    f"drop {'it' if len(given) == 1 else 'them'} for full fine-tuning"
                )
            return
        if self.lora_alpha is not None and self.lora_alpha <= 0:
            raise ConfigError(
                f"--lora_alpha must be positive, got {self.lora_alpha} (default: {LORA_ALPHA_PER_RANK} * --lora_r)"
            )
        if self.lora_dropout is not None and not 0 <= self.lora_dropout < 1:
            raise ConfigError(f"--lora_dropout must be in [0, 1), got {self.lora_dropout} (default: {LORA_DROPOUT})")
        self.lora_target_modules = lora_targets(self.lora_target_modules)
        if self.merge_lora and (getattr(self, "fsdp", None) or getattr(self, "deepspeed", None)):
            raise ConfigError(
                "--merge_lora merges the adapters into a model held whole by one process, which FSDP and DeepSpeed "
                "do not give: drop --merge_lora and merge the saved adapter afterwards, e.g. "
                "PeftModel.from_pretrained(base_model, output_dir).merge_and_unload().save_pretrained(folder)"
            )
        if importlib.util.find_spec("peft") is None:
            raise ConfigError(
                f"--lora_r needs peft, which is not installed: {PEFT_INSTALL} (from a checkout: pip install -e "
                "'.[peft]'), or drop the LoRA flags for full fine-tuning"
            )


def lora_targets(value: str | list[str] | None) -> str | list[str] | None:
    """``--lora_target_modules`` as peft takes it: None (peft's default), ``"all-linear"``, or a list of names.

    A comma-separated string and a YAML list mean the same, so a config file and the command line agree.
    """
    if value is None:
        return None
    items = value.split(",") if isinstance(value, str) else [str(item) for item in value]
    names = [name for item in items for name in (part.strip() for part in item.split(",")) if name]
    if not names:
        raise ConfigError(
            f"--lora_target_modules {value!r} names no module: pass comma-separated module names (e.g. "
            f"q_proj,v_proj) or {ALL_LINEAR}, or leave it out for peft's default"
        )
    linear = [name for name in names if name.lower().replace("_", "-") == ALL_LINEAR]
    if linear and len(names) > 1:
        raise ConfigError(f"--lora_target_modules: {ALL_LINEAR} already targets every linear layer; pass it alone")
    return ALL_LINEAR if linear else names
