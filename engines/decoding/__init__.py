"""What shapes an engine's output: guided decoding, structured outputs, tool-call parsing, text and stops."""
