//! Memory the CPU backend owns outside the mapped file: buffers on transparent huge pages and the
//! arena that carves the repacked weight copies out of them (`hugebuf`), the paged KV cache's K and
//! V planes (`kv_plane`), and the read-bandwidth probe `infer bench` holds decode against
//! (`bandwidth`).

pub mod bandwidth;
pub mod hugebuf;
pub mod kv_plane;
