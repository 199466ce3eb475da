"""The one pipeline every generating API goes through: prepare, admit, generate, respond, settle."""
