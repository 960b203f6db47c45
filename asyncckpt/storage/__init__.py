"""Where bytes become durable: the file operations the writer and the read side share."""
