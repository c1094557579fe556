"""A training step perflab did not write: the contract (``contract``), loading a factory named
``package.module:function`` (``load``), perflab's own MMDiT as the default factory (``mmdit``),
example factories for models no one here wrote (``examples``), and what labs 01, 05, 07 and 08
measure on any such step (``profile``, ``memory``, ``stability``, ``levers``)."""
