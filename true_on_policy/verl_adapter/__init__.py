"""The adapter layer: every place that touches verl's API lives in this package.

verl's API drifts between releases; keeping the touch points here, each in a module named for what
it touches, keeps the rest of the project (the pure core) independent of verl.
"""

# Import verl before any adapter module runs: verl's __init__ loads this project's plugin
# (true_on_policy.verl_adapter.plugin), which imports the adapter modules. Were an adapter module
# imported first (a Ray worker unpickling CPUServer, a test), its own ``from verl...`` line would
# start that plugin load halfway through the module and find it partially initialised.
import verl  # noqa: F401
