"""Built-in grad samplers, one file per layer family. Importing this package registers them."""
