"""trainguard.worker: the worker API (``trainguard.init()`` and its handle), the worker-side
composition root. It may import the core and the features, never the agent (``runtime``)."""
