"""true-on-policy: FlashREINFORCE and bitwise training/rollout consistency for verl.

Importing this package is inert. verl loads ``true_on_policy.verl_adapter.plugin`` through the
``verl.plugins`` entry point; that module registers functions and nothing else. Behaviour changes
(the CPU backend, the consistent kernels) switch on only when a config asks for them.

Layout: a pure core that never imports verl (``flashreinforce``, ``invariants``, ``settings``,
``consistent_ops``, ``consistent_model``, ``cpu_rollout_engine``, ``tensor_parallel``,
``prompt_ledger``, ``contract``, ``determinism_env``, ``diagnose``, ``logdiff``, ``tiny_assets``) and
one adapter package, ``verl_adapter``, that holds every place touching verl's API.
"""

__version__ = "0.1.0"
