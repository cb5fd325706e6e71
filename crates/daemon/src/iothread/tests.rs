//! Unit tests of the queue slot and the executor over mock guest memory.
