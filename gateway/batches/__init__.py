"""The Batch API: OpenAI's /v1/files and /v1/batches, Anthropic's /v1/messages/batches, and the
runner that sends each line through the same admission as any request (gateway/serving/admission.py), in
the scheduler's lowest class, priced at the batch price. docs/batches.md tells the whole story."""
