"""The recipe's thin entry point: verl's own ``main_ppo`` on the recipe's config folder.

    python -m recipe.true_on_policy.main_true_on_policy [--config-name NAME] [hydra overrides...]

It is ``python -m verl.trainer.main_ppo`` with another default config: verl's ``main`` calls
``auto_set_device``, which the plugin wraps to run the launch verdict before Ray starts, then verl's
``run_ppo``. Nothing of verl's trainer is copied or forked.
"""

from __future__ import annotations

import hydra
from verl.trainer import main_ppo


@hydra.main(config_path="config", config_name="true_on_policy_trainer", version_base=None)
def main(config) -> None:
    main_ppo.main.__wrapped__(config)


if __name__ == "__main__":
    main()
