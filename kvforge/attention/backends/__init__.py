"""The attention backend objects (one interface, :mod:`.base`), registered by declaration name."""
