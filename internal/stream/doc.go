// Package stream is the V2 write path (Ozone's Ratis streaming, HDFS's
// DataTransferProtocol): a client streams one block to the pipeline's
// datanode nearest to it, which writes each packet to its block file and
// forwards it to the next datanode of the route, and so on down the chain;
// acks flow back up. The data never enters a Raft log: after the stream
// closes, the client commits the block with one PutBlock (wait_all)
// through the pipeline's Raft group, carrying the chunk list and checksums
// the Writer computed.
//
// The protocol has its own TCP port (DatanodeDetails.stream_addr); a
// connection carries one stream at a time, and after a clean close the
// next stream of the same route (see "Reuse"). A datanode serves protocol
// versions 4 (the previous release) and 5; see "Versions". Integers are big-endian. Every frame carries a
// CRC32C of itself (header, packet header, ack; payloads have their own),
// and every length is checked against its limit (MaxRoute, the address
// limit, the header's packet size, MaxPacketSize, the reason limit)
// before anything is allocated for it, so a damaged or hostile frame
// fails the stream with an error instead of being acted upon.
//
// Header, client → first datanode, and each datanode → the next:
//
//	magic u32 "BSTR" | version u8 (5, or 4) | hop u8 | body length u16
//	pipeline u64 | container u64 | local u64 | start offset u64
//	packet size u32 | route length u16 | route: {datanode u64, addr len u16, addr}…
//	token length u16 | block token (at most MaxToken bytes)
//	payload key length u8 (0, 16 or 32) | payload key (hop > 0 of a secured stream only)
//	CRC32C of everything above u32
//
// The route is what remains after the receiver. A datanode checks the
// block token (every hop: the token travels down unchanged), that it
// is in the pipeline, that the container is open (or creates it, as the
// first V1 write does) and that the block is not committed at another
// length, connects to the next hop with the rest of the route, and acks
// the header only after the next hop did.
//
// Packet, upstream → downstream (32 bytes, then the payload):
//
//	kind u8 (2 data, 3 close) | 0 u8 | 0 u16 | length u32
//	seq u64 | offset u64 | CRC32C of the payload u32 | CRC32C of the 28 bytes before u32
//
// A close carries the next seq and the final length as its offset.
//
// Ack, downstream → upstream (32 bytes, then an error's reason):
//
//	kind u8 (0x81 header, 0x82 data, 0x83 close, 0xff error) | code u8 | reason len u16 | CRC32C u32
//	seq u64 | value u64 (start offset, end of the packet, final length) | datanode at fault u64
//
// The ack's CRC32C covers its 32 bytes (the CRC word read as zero) and the
// reason.
//
// A datanode acks packet i only after its own write of i completed and
// the next hop acked i, so a client's ack means the packet is on every
// disk of the route (synced only at close). An error ends the stream: it
// travels up unchanged, naming the datanode that failed (refused, could
// not be reached, stalled past the timeout, or dropped its connection);
// every datanode of the route discards what it stored for the block
// (Sink.Abort) and the client retries on another block from its buffer.
//
// The Writer sums each payload byte once with CRC32C, for the chunk list's
// windows, and combines the packet CRC from those (package crc32c).
//
// Records (protocol version 4, and 5 with Reuse below; record.go). On a secured stream port the
// mutual TLS 1.3 handshake, the header and the header ack go through
// crypto/tls. The acceptor checks that crypto/tls holds no input past the
// header and derives its keys before it sends the ack; the opener does the
// same after reading it; the opener sends nothing in between, so the
// switch is a lockstep. crypto/tls reads through a tlsFramer, which hands
// it one TLS record at a time, so it never holds what the acceptor sends
// as records right behind the ack (an error ack, if the stream fails at
// once): those bytes wait in the socket for the opener's records. From
// then on the raw TCP connection carries records:
//
//	kind u8 (1 control, 2 payload) | 0 u8 | 0 u16 | sealed length u32 | AES-GCM ciphertext and tag
//
// with the 8 record-header bytes as additional data. Control records
// (packet headers, acks; at most 2 KiB) are sealed with a key per
// direction exported from the TLS session (ExportKeyingMaterial); payload
// records with the stream's payload key, exported from the session of the
// client and the first datanode with the stream's number on the
// connection (0, 1, …) as the context, and sent down the route in the
// header's last field (through TLS, or control records when reused),
// with the packet's 32-byte header as further additional data. Nonces are a per-key counter. The client seals a
// payload once; a datanode forwards the record as it arrived (one writev
// with the re-sealed packet header) and opens it in place in its aligned
// buffer. Any refused record fails the stream.
//
// Reuse (protocol version 5, connpool.go). After a clean close (the
// client's Writer got the close ack; every hop acked its downstream's close
// ack and wrote its own; nothing failed; nothing unread) the connection
// stays open: the client's Writer hands it to its ConnPool (keyed by the
// whole route and the TLS configuration; bounded in number and idle time),
// and the next Dial for that route sends its header on it, as control
// records on a secured connection (their counters go on; plaintext as a
// frame), and reads the header ack the same way. Each hop checks a next
// header as it checks a first (the same hop, the opener's certificate, the
// route's entries, the block token in its Backend) and derives the
// stream's payload key (hop 0: exported with the stream's number; later
// hops: from the header, refused if equal to the last one's), then keeps
// its connection to the next datanode if the route below is the same
// (the header goes down as control records) or closes it and dials the
// new next hop. The payload records of each stream start at nonce 0 under
// their own key: no (key, nonce) pair is ever used twice. A hop waits for
// a next header at most ServerConfig.ReuseIdle + hop·Timeout (longer than
// the hop above it, which then closes its connection down; clients pool
// for less, DefaultPoolIdle), and at most ServerConfig.MaxIdle
// connections wait at once (one beyond is closed). A connection carries
// streams for at most MaxConnAge after its handshake (datanode, 15 min;
// the pool: DefaultPoolMaxAge, 10 min; a hop reuses its connection down a
// margin less) and never past its peer's certificate's NotAfter. Any
// failure of a stream (an error ack, a refused header or record, a lost
// connection, an abort) closes its connections on every hop: a connection
// in an unknown state is never reused.
//
// A peer may close a kept connection at any time (its idle or age bound,
// beyond its MaxIdle, on restart); the bounds above only make the closer
// end usually the one that decides. So the client (Dial) and every hop
// (for its connection down) peek at a kept connection, without blocking,
// right before writing a header into it: closed (or holding input) -> it
// is dropped and a new connection carries the header; nothing of the
// stream reached the peer. If the header's write itself fails, the peer
// cannot have read it whole, and the header is sent once on a new
// connection. Any failure after the header was written is the stream's
// (the peer may have opened the stream; a second stream of the same
// block on it could abort the first's file): the client's Writer fails
// with it, or a hop fails the stream naming the next datanode, and the
// client retries with a new block as for any failed stream. A close that
// crosses the header on the wire therefore still fails that one stream,
// but it is not blamed on the peer: a kept connection that ends (end of
// file or a reset) before any byte of the header's answer arrived fails
// the stream with CodeStale naming the peer (the client's Dial for its
// connection; a hop for its connection down, sent up as an error ack).
// That is all a close crossing the header can look like; a peer that
// died after reading the header looks the same, one that answered
// anything, refused, or held the connection without answering does not.
// The client abandons the stream (no header ack: nothing of it can be
// committed; never the same block again, which the peer may have
// opened: a forged FIN or reset cannot make two streams of one block),
// excludes nothing, and writes the data again as a new block on new
// connections (Options.Fresh: no hop has a kept connection then); a peer
// that really died fails there and is excluded. The client (client
// package) allows this at most once per segment and once per datanode
// named per key, and opens the key's later streams on that route Fresh
// too; a second CodeStale naming the same datanode in the key is blamed.
// CodeStale is honoured only in answer to a header on a kept connection:
// the Writer turns it into CodeConnLost on a new connection or after the
// header ack, and so does a hop for an error ack over a new connection
// down (a hop reports stale only for its own kept connection down, or
// relays one over it; only the hop whose connection ended counts
// Stats.DownStaleHeaders). So a datanode cannot spare itself the blame
// with it beyond one retry per key.
// A recovered panic while waiting for or checking a next header ends the
// connection only: the stream before it, acked, is no longer the
// connection's and keeps its data.
//
// Versions (rolling upgrades). A datanode accepts a first header of
// version MinVersion (4) or Version (5) and runs the stream with that
// version's semantics on every hop: a version 4 stream uses the v4
// exporter labels ("EXPORTER-basalt-stream-v4 …") and a payload key
// exported without a context, goes down the route at version 4, and its
// connections close after it (no Reuse; the client never pools them); a
// version 5 connection accepts only version 5 next headers. An opener
// picks the route's version (Options.Version): the client takes 4 when
// a datanode of the route advertises less than 5 (DatanodeDetails.
// stream_version; 0 from a datanode that predates the field), else 5,
// and if a datanode answers "version 5, this datanode speaks 4" (the
// previous release's refusal, a CodeBadHeader error ack through TLS,
// relayed unchanged by the hops above after they discarded the block:
// Refused), Dial opens the same block once more at 4 on new connections
// (Writer.Downgraded, Writer.RefusedBy: the client then opens routes
// through that datanode at 4 for a while); nothing is blamed. Stats.V4Streams counts version
// 4 streams. ServerConfig.OnlyVersion 4 makes a server behave on the
// wire as a version 4 datanode did (tests).
//
// A header of a version a datanode does not serve gets a CodeBadHeader
// error ack whose reason ends in "version V, this datanode speaks MIN to
// MAX" ("speaks N" from a datanode that serves one version: the previous
// release, or OnlyVersion). The suffix is a stable, parsed format, not
// free text: Refused parses the previous release's, and a later
// release's opener will parse this one to fall back to 5 (record_test.go
// TestOldVersionRefusedClearly pins it).
//
// The fallback reopens the same block, where a stale kept connection
// (CodeStale) makes the client write a new block. That is safe because
// of an invariant the server keeps, which a change to the refusal path
// must keep: a refusal reaches the client only after every hop above the
// refuser discarded the block (each runs abortSink before it relays the
// refusal, in the same goroutine), no payload has been sent (the
// fallback is only in Dial, before any header ack), and the refuser
// forwarded nothing (it refuses before it dials on). So when the client
// reopens the block, no hop holds a stream of it, and only the version 4
// Writer can commit it. (A datanode that forges the refusal while it
// keeps its own stream open below gains nothing it lacks: with the
// block token it can already open and abort a stream of that block.
// Storage does not enforce one open stream per block.)
//
// Data path on a datanode: the payload is read from the socket into a
// pooled 4 KiB-aligned buffer (the one copy), forwarded from that buffer
// with one writev of header and payload, verified against its CRC and
// written to the block file from the same buffer, which lets storage use
// O_DIRECT without a bounce copy.
package stream
