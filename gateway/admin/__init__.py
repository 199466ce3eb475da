"""The admin API under /admin/, authorised by the admin key."""
