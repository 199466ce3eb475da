"""The monthly close: invoices, documents, statements, credit notes, and their rendering."""
