"""The defaults of `offline-agent finetune` are PPOConfig's: what `--help` shows is what a run uses."""

from __future__ import annotations

import inspect
import re
from dataclasses import fields

from offline_agent.cli import finetune_command
from offline_agent.online.config import DEFAULT_LEARNING_RATES, DEFAULT_TARGET_KL, PPOConfig

# CLI options whose default is None there because PPOConfig fills it from other settings.
FILLED_BY_CONFIG = {"target_kl", "learning_rate", "value_learning_rate", "validation_seed"}


def _cli_defaults() -> dict[str, object]:
    return {
        name: getattr(parameter.default, "default", parameter.default)
        for name, parameter in inspect.signature(finetune_command).parameters.items()
    }


def test_every_finetune_option_that_is_a_config_field_defaults_to_the_config():
    config, cli = PPOConfig(), _cli_defaults()
    shared = [f.name for f in fields(PPOConfig) if f.name in cli and f.name not in FILLED_BY_CONFIG]
    assert len(shared) >= 20  # the options are matched by name: a rename would silently drop them
    for name in shared:
        assert cli[name] == getattr(config, name), name


def test_the_defaults_filled_by_the_config_are_the_ones_the_help_names():
    helps = {name: parameter.default.help for name, parameter in inspect.signature(finetune_command).parameters.items()
             if hasattr(parameter.default, "help")}
    assert f"[default: {DEFAULT_TARGET_KL}]" in helps["target_kl"]
    rates = DEFAULT_LEARNING_RATES
    residual, copy = re.search(r"\[default: (\S+) residual, (\S+) copy\]", helps["learning_rate"]).groups()
    assert (float(residual), float(copy)) == (rates["residual"], rates["copy"])
    assert f"[default: PPOConfig's, {PPOConfig.validation_seed}]" in helps["validation_seed"]
    assert PPOConfig().target_kl == DEFAULT_TARGET_KL
    assert PPOConfig().learning_rate == rates["residual"]
