"""Packing plans: a padded ``[B, S]`` batch (its mask, its lengths, or documents cut at EOD tokens) becomes one plan
of offsets and indices per micro-batch, applied to every tensor of it (``pack``) and back (``unpack``)."""
