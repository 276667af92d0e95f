"""What a ring carries (``Piece.transport``): ``"kv"``, the attention's K and V (every model), or
``"latent"``, a multi-latent attention layer's compressed KV latent and rotary key, which each
ring member re-expands into K and V with the layer's up-projection (``runtime/ring_transport``)."""

RING_TRANSPORTS = ("kv", "latent")
