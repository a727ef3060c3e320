"""true-on-policy: FlashREINFORCE and bitwise training/rollout consistency for verl.

Importing this package is inert. verl loads ``true_on_policy.verl_adapter.plugin`` through the
``verl.plugins`` entry point; that module registers functions and nothing else. Behaviour changes
(the CPU backend, the consistent kernels) switch on only when a config asks for them.

Layout: a pure core that never imports verl, by concern: ``loss`` (FlashREINFORCE), ``config``
(the ``true_on_policy:`` section and invariants), ``kernels`` (order-fixed ops and the models on them),
``rollout`` (the CPU reference engine, the prompt ledger), ``contract`` (consistency contract and
determinism plan), ``diagnose``, ``cli``, ``tiny_assets``; and one adapter package, ``verl_adapter``,
that holds every place touching verl's API.
"""

__version__ = "0.1.0"
