"""The Batch API's storage: files, batches and their lines."""
