"""What runs on each cluster node: its host actor (:mod:`.actor`) around a :class:`.host.NodeHost`."""
