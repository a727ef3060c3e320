"""The project's Hydra configs, shipped inside the package: compose them as ``pkg://true_on_policy.configs``.

``common/true_on_policy.yaml`` is the ``true_on_policy:`` section with every key at its default; the
top-level files are runnable jobs (``--config-path pkg://true_on_policy.configs --config-name cpu_tiny``).
The repository's top-level ``configs`` is a link to this folder, not a copy.
"""
