"""The built-in strategies, one module each, registered through entry points like any other."""
