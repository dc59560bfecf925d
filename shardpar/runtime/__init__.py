"""The MiCS engine: units and their life cycle, prefetch under the live cap, the gradient reducer, the
accumulation window, the hooks, and DistributedModel that builds them. The only code that touches a
unit's fields; everything above reads and writes the sharded state through runtime/state.py."""
