//! How the CPU backend runs work on several cores: the persistent thread pool (`pool`), how a
//! decode region's units are shared between its threads (`split`), and which region comes next so
//! a worker can prefetch its first bytes early (`chain`). Invariant: every parallel region joins
//! all its threads before the call that started it returns.

pub mod chain;
pub mod pool;
pub mod split;
