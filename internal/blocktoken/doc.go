// Package blocktoken is Basalt's block access token: what a datanode
// checks before it serves a read or takes a write, so that reaching a
// datanode's port is not enough to read any block by ID or to write into a
// container SCM never allocated.
//
// A token is issued by the namespace manager with every block location it
// returns (OpenKey, AllocateBlock: write; LookupKey: read) and binds:
//
//	key ID | block (container, local ID) | modes (read, write, delete) | expiry | pipeline | owner
//
// A write token names the pipeline the block's container was allocated
// to, and a datanode takes the write only through that pipeline
// (Claims.CheckPipeline): otherwise a client could send the writes for a
// container of pipeline P1 through another pipeline P2 that shares a
// datanode, whose log would adopt the container there.
//
// under an HMAC-SHA256 with a secret key that SCM generates, keeps in its
// Raft log and hands to datanodes at registration and with every
// heartbeat. Symmetric keys make issuing and checking a token cost about
// a microsecond (Ozone's HDDS-7733 replaced RSA signatures for the same
// reason: several milliseconds per read).
//
// Rotation needs no pause: a new key is recorded with an activation time
// some heartbeats in the future, so every datanode has it before the
// namespace signs with it (SigningKey picks the newest active key), and a
// verifier accepts any key it holds; SCM drops a key only once tokens
// signed with it have all expired. A forced rotation (a meta node was
// removed, and held the keys) gives the older keys a retire time
// (Key.RetireUnixMs): from then on, by each verifier's own clock, they
// neither sign nor verify (ErrRetired), whether or not SCM has dropped
// them yet.
//
// Wire format (version 2), big-endian, at most MaxTokenSize bytes:
//
//	version u8 | modes u8 | owner length u8 | 0 u8
//	key ID u64 | container u64 | local ID u64 | expiry unix ms i64
//	pipeline u64 | owner | HMAC-SHA256 of everything before (32 bytes)
//
// Version 1 is the same without the pipeline; such tokens still decode
// (pipeline 0), so they grant reads but no writes.
//
// Decode checks every length before it looks further; Verify compares the
// MAC in constant time before it looks at what the token claims.
package blocktoken
