"""Small pieces every process uses: the frame-thread pool, /proc readings, fault injection."""
