"""The ``dynamic`` packer (dynmb's own method): rows and affine costs (``setup``), the search space of
candidates and the other methods' plans (``space``), their ranking by estimate (``rank``), and the packer
itself (``pack``)."""
