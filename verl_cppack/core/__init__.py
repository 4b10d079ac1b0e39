"""The index math of packing, on the host and without communication: how much padding each slot gets, how the
padded stream is cut across CP ranks, the one device->host read of a plan, and the argument checks every public
entry point shares."""
