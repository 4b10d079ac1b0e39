"""The one collective of the gather-back: every CP rank's local stream all-gathered, with its gradient contracts."""
