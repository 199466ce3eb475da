"""The usage ledger: the writer, its journal, the Postgres COPY path, partitions, aggregates."""
