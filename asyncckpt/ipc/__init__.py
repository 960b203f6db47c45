"""What crosses between a rank and its writer: the control messages and the shared-memory
ring their tensor bytes travel in. Both processes import this package; it imports neither."""
