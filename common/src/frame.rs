//! The data-plane wire format: fixed little-endian headers, payload bytes after them.
//!
//! Payloads never travel inside protobuf: a response is a 24-byte header followed by the raw
//! bytes, so a worker can write a block from memory or a file straight to the socket.
//! Parsing is sans-IO (byte slices in, values out) so it can be tested and fuzzed alone.
//!
//! ```text
//! request  = "STQ1" op:u8 0:u8 0:u16 body_len:u32 | body
//! body     = req_id:u64 file_size:u64 block_size:u64 block_index:u64 offset:u64 len:u64
//!            path_len:u16 path version_len:u16 version
//! response = "STR1" status:u8 source:u8 0:u16 req_id:u64 payload_len:u64 | payload
//! ```
//! `OpenBlock` (body = a read's body, then `grant_kind:u8`) asks for the range as a grant of
//! that kind and answers a 40-byte [`BlockGrant`] instead of the bytes: kind 1 is a file
//! descriptor passed with the answer (short-circuit; only a Unix socket can carry it), kind 2 a
//! registered memory region (RDMA), kind 3 a descriptor only if it costs the worker no copy
//! (else `ResourceExhausted`); `Release` (body `lease_id:u64 grant_kind:u8`, no response)
//! ends a grant's lease early; `RemoteRead` (body `req_id:u64 addr:u64 rkey:u32
//! len:u64`) reads granted registered memory — RDMA's one-sided READ, emulated over TCP;
//! `RdmaConnect` (body an [`RdmaEndpoint`], answered by the worker's) connects a real RDMA queue
//! pair for as long as its connection stays open.
//! `View` (body `req_id:u64`) asks a worker or sidecar for its last view of the cluster — the
//! membership and the client-facing mount table (no secrets) it last learnt from the master —
//! answered as a data response whose payload is that view as the master's protobuf
//! (`strata_proto::WorkerView`), which this codec does not look into; `Stat` (body `req_id:u64
//! path_len:u16 path`) asks the worker to stat a path at the UFS itself, answered by a
//! [`FileStat`]. Both let a client go on, or start, while the master is unreachable.
//! `Auth` (body = a token) says who the client is: the first frame of every connection to a
//! cluster that requires tokens, answered only when refused.
//! `ReadMany` (body `count:u32` then that many read bodies, each with its own `req_id`; see
//! [`ReadMany`]) asks for many block ranges in one round trip: the worker answers with one
//! ordinary response frame per item, in the order asked, an error frame for an item it cannot
//! serve and data for the others.
//! `status` 0 is success and the payload is data; otherwise it is an [`ErrorKind`] code and
//! the payload a UTF-8 message.
//!
//! A write replaces one whole file, streamed on one connection (see [`WriteBegin`]):
//! ```text
//! WriteBegin  body = req_id:u64 path_len:u16 path [write-back]
//!                                                     → response (no payload): go ahead, or error
//! WriteData   body = bytes (≤ MAX_WRITE_CHUNK)        (no response)
//! WriteEnd    body = empty | holders                 → response (no payload): committed, or error
//! ```
//! On a `mode=write-back` mount a client streams the same file to `write_replicas` workers at
//! once; `WriteBegin` then carries `id_len:u8 write_id rank:u8` (rank 0 is the primary). A
//! `WriteBegin` may end with `flags:u8` after that part (written `0:u8 flags:u8` when it is not a
//! write-back copy): bit 0 appends to the file instead of replacing it ([`WriteFlags`]); no other
//! bit is defined. A worker that predates the flags refuses such a body as malformed, so an
//! append is never taken for a replacement. A
//! replica answers its `WriteEnd` once its journal is durable; the client then ends the
//! primary's stream with the replicas that did (`count:u8 (len:u8 worker_id)*`), and the
//! primary answers once its own journal is durable and the master has the file.
//! A failure in the middle is answered at `WriteEnd` (the data frames already sent are read and
//! dropped, so the connection stays in sync); closing the connection before `WriteEnd` aborts
//! the write and leaves the old object in place.
//!
//! A copy is one request, made by the worker end to end (see [`CopyRequest`]):
//! ```text
//! Copy  body = req_id:u64 src_len:u16 src dst_len:u16 dst version_len:u16 version size:u64
//!                                    → response, payload = via:u8 bytes:u64 ([`CopyAnswer`])
//! ```
//! The worker answers once the destination exists in the UFS (the UFS copied it, or the worker
//! streamed the source's blocks through its cache into a writer of the destination); no byte of
//! the file crosses the client's connection. `version`/`size` name a write-back version the
//! client knows (its holders' journals have it, not the UFS); empty for any other file, whose
//! version the worker reads from the UFS at the time of the copy.

use thiserror::Error;

use crate::error::ErrorKind;
use crate::qos::QosClass;

pub const REQUEST_MAGIC: [u8; 4] = *b"STQ1";
pub const RESPONSE_MAGIC: [u8; 4] = *b"STR1";
pub const REQUEST_HEADER_LEN: usize = 12;
pub const RESPONSE_HEADER_LEN: usize = 24;
/// Largest request body: fixed fields plus a maximal path and version.
pub const MAX_REQUEST_BODY: usize = 48 + 2 + crate::path::MAX_PATH_LEN + 2 + MAX_VERSION_LEN;
pub const MAX_VERSION_LEN: usize = 1024;
/// Largest error message a worker sends (longer ones are cut).
pub const MAX_ERROR_MESSAGE: usize = 4096;
/// Largest body of one `WriteData` frame.
pub const MAX_WRITE_CHUNK: usize = 8 << 20;

/// Request operations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Op {
    /// Read a byte range of one block.
    ReadBlock = 1,
    /// Start replacing a file ([`WriteBegin`]).
    WriteBegin = 2,
    /// Bytes of the file being written, in order.
    WriteData = 3,
    /// Commit the file being written.
    WriteEnd = 4,
    /// Ask for a block range as a [`BlockGrant`] of the [`GrantKind`] the body names, instead
    /// of bytes ([`OpenBlock`]).
    OpenBlock = 5,
    /// Give back a grant's lease early ([`LeaseRelease`]); no response.
    Release = 6,
    /// Read bytes of registered memory named by a grant ([`RemoteRead`]): what an RDMA READ
    /// does one-sided, emulated over TCP to test the RDMA protocol where no NIC exists.
    RemoteRead = 7,
    /// Connect an RDMA queue pair to the worker's ([`RdmaEndpoint`] body, answered by the
    /// worker's endpoint as a data response). The connection carries nothing else afterwards;
    /// the worker's queue pair lives until it closes.
    RdmaConnect = 8,
    /// The worker's last view of membership and mounts (body `req_id:u64`; payload opaque here).
    View = 9,
    /// Stat a path at the UFS through the worker's mount ([`StatRequest`] → [`FileStat`]).
    Stat = 10,
    /// Who the client is: the connection's first frame when the cluster requires tokens
    /// ([`auth_request`]; body = the token's bytes). No answer when accepted; when refused, an
    /// error frame (kind `unauthenticated`, request id 0) and the connection closes.
    Auth = 11,
    /// A block range from the worker's tiers alone ([`ReadBlockRequest`] body): a miss is
    /// answered `not_found`, never fetched. What a new owner asks the block's previous owner
    /// before the UFS when the ring changed (peer fetch), so a peer's miss costs no UFS read.
    PeerRead = 12,
    /// Blocks a worker holds and whose first owner on the ring is now the worker asked
    /// ([`HandOffOffer`]): the answer's payload is one byte per block offered, 1 where the
    /// receiver wants it pushed (it lacks the block and has room in its hand-off queue).
    HandOffOffer = 13,
    /// One whole block pushed to its new owner after an offer ([`HandOffBlock`]); answered
    /// with an empty data frame when kept, an error (`unavailable`) when the receiver dropped it.
    HandOffBlock = 14,
    /// A block range a read replica asks the block's first owner for ([`ReadBlockRequest`]
    /// body): answered from its tiers, or fetched through its single flight on a miss, so two
    /// replicas missing one cold block at once read the UFS once. Not counted as bytes served
    /// to clients.
    PeerFetch = 16,
    /// Copy one file to another path, inside the cluster ([`CopyRequest`] → [`CopyAnswer`]).
    Copy = 18,
    /// Many block ranges in one request ([`ReadMany`]): one response frame per item, in the
    /// order of the items, each under the item's own request id.
    ReadMany = 17,
    /// The whole blocks a reader will ask for next, in order ([`PrefetchHints`]): they replace
    /// what the same stream hinted before, and the worker fetches them in its prefetch lane.
    /// Answered with a data frame whose payload is `accepted:u32`.
    Prefetch = 19,
    /// The request class of every later request on this connection ([`class_request`]; body
    /// `class:u8`, a [`QosClass`]), sent after `Auth` on a new connection. No answer when
    /// accepted; an unknown class is answered with an error frame (kind `bad_frame`, request
    /// id 0) and the connection closes. Without it a connection is `throughput`.
    Class = 20,
}

/// Where a worker found the bytes it returns (for metrics and tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Source {
    Memory = 0,
    Nvme = 1,
    Ufs = 2,
}

impl Source {
    pub fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            0 => Self::Memory,
            1 => Self::Nvme,
            2 => Self::Ufs,
            _ => return None,
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadBlockRequest {
    pub req_id: u64,
    /// Strata path of the file (normalised, absolute).
    pub path: String,
    /// The file's UFS version as the client learnt it from `stat`.
    pub version: String,
    pub file_size: u64,
    pub block_size: u64,
    pub block_index: u64,
    /// Offset inside the block.
    pub offset: u64,
    pub len: u64,
}

#[derive(Debug, Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum FrameError {
    #[error("bad magic {0:02x?}")]
    BadMagic([u8; 4]),
    #[error("unknown op {0}")]
    UnknownOp(u8),
    #[error("request body of {0} bytes exceeds the limit of {MAX_REQUEST_BODY}")]
    BodyTooLarge(usize),
    #[error("truncated or malformed body")]
    Malformed,
    #[error("field is not valid UTF-8")]
    NotUtf8,
}

impl ReadBlockRequest {
    pub fn encode(&self) -> Vec<u8> {
        self.encode_with(Op::ReadBlock, 0)
    }

    /// The same range asked of a peer's tiers alone ([`Op::PeerRead`]).
    pub fn encode_peer(&self) -> Vec<u8> {
        self.encode_with(Op::PeerRead, 0)
    }

    /// The same range asked of the block's first owner, fetched there on a miss
    /// ([`Op::PeerFetch`]).
    pub fn encode_peer_fetch(&self) -> Vec<u8> {
        self.encode_with(Op::PeerFetch, 0)
    }

    /// The same range asked for as a grant of `kind` ([`Op::OpenBlock`]).
    pub fn encode_open(&self, kind: GrantKind) -> Vec<u8> {
        let mut out = self.encode_with(Op::OpenBlock, 1);
        out.push(kind as u8);
        out
    }

    /// The request under `op`, with room announced for `extra` body bytes the caller appends.
    fn encode_with(&self, op: Op, extra: usize) -> Vec<u8> {
        let body_len = self.body_len();
        let mut out = Vec::with_capacity(REQUEST_HEADER_LEN + body_len + extra);
        out.extend_from_slice(&request_header(op, body_len + extra));
        self.write_body(&mut out);
        out
    }

    /// Bytes of this request's body (what a [`ReadMany`] item takes).
    pub fn body_len(&self) -> usize {
        48 + 2 + self.path.len() + 2 + self.version.len()
    }

    fn write_body(&self, out: &mut Vec<u8>) {
        for v in [self.req_id, self.file_size, self.block_size, self.block_index, self.offset, self.len] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out.extend_from_slice(&(self.path.len() as u16).to_le_bytes());
        out.extend_from_slice(self.path.as_bytes());
        out.extend_from_slice(&(self.version.len() as u16).to_le_bytes());
        out.extend_from_slice(self.version.as_bytes());
    }

    pub fn decode_body(body: &[u8]) -> Result<Self, FrameError> {
        let mut r = Reader { buf: body, pos: 0 };
        let req = Self::read_from(&mut r)?;
        if r.pos != body.len() {
            return Err(FrameError::Malformed);
        }
        Ok(req)
    }

    /// One body from where `r` stands (the fields say where it ends).
    fn read_from(r: &mut Reader<'_>) -> Result<Self, FrameError> {
        let req_id = r.u64()?;
        let file_size = r.u64()?;
        let block_size = r.u64()?;
        let block_index = r.u64()?;
        let offset = r.u64()?;
        let len = r.u64()?;
        let path = r.string()?;
        let version = r.string()?;
        Ok(Self { req_id, path, version, file_size, block_size, block_index, offset, len })
    }
}

/// Most items one [`ReadMany`] carries.
pub const MAX_READ_MANY_ITEMS: usize = 256;
/// Largest [`ReadMany`] body: 256 items of short paths fit many times over; a client whose
/// items have long paths sends fewer per request (see [`ReadMany::fits`]).
pub const MAX_READ_MANY_BODY: usize = 1 << 20;

/// Many block ranges asked in one request ([`Op::ReadMany`]): `count:u32`, then `count` read
/// bodies as [`ReadBlockRequest`] encodes them, back to back (each says where it ends). At
/// least one item and at most [`MAX_READ_MANY_ITEMS`]; the body at most
/// [`MAX_READ_MANY_BODY`] bytes. Answered by one response frame per item, in this order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadMany {
    pub items: Vec<ReadBlockRequest>,
}

impl ReadMany {
    /// Whether `next` can join items whose bodies take `body` bytes (and `count` of them)
    /// without going over the limits.
    pub fn fits(count: usize, body: usize, next: &ReadBlockRequest) -> bool {
        count < MAX_READ_MANY_ITEMS && 4 + body + next.body_len() <= MAX_READ_MANY_BODY
    }

    /// The request frame. The caller keeps within the limits ([`fits`](Self::fits)); a worker
    /// refuses a frame over them as malformed.
    pub fn encode(&self) -> Vec<u8> {
        let body_len = 4 + self.items.iter().map(ReadBlockRequest::body_len).sum::<usize>();
        let mut out = Vec::with_capacity(REQUEST_HEADER_LEN + body_len);
        out.extend_from_slice(&request_header(Op::ReadMany, body_len));
        out.extend_from_slice(&(self.items.len() as u32).to_le_bytes());
        for item in &self.items {
            item.write_body(&mut out);
        }
        out
    }

    pub fn decode_body(body: &[u8]) -> Result<Self, FrameError> {
        if body.len() > MAX_READ_MANY_BODY {
            return Err(FrameError::BodyTooLarge(body.len()));
        }
        let mut r = Reader { buf: body, pos: 0 };
        let count = r.u32()? as usize;
        if count == 0 || count > MAX_READ_MANY_ITEMS {
            return Err(FrameError::Malformed);
        }
        let mut items = Vec::with_capacity(count);
        for _ in 0..count {
            items.push(ReadBlockRequest::read_from(&mut r)?);
        }
        if r.pos != body.len() {
            return Err(FrameError::Malformed);
        }
        Ok(Self { items })
    }
}

/// Most blocks one [`PrefetchHints`] names.
pub const MAX_PREFETCH_ITEMS: usize = 4096;
/// Largest [`PrefetchHints`] body.
pub const MAX_PREFETCH_BODY: usize = 4 << 20;

/// Whole blocks a reader will ask for next, in the order it will ([`Op::Prefetch`]):
/// `req_id:u64 stream:u64 count:u32`, then `count` bodies as [`ReadBlockRequest`] encodes them
/// (offset and length ignored: whole blocks). `stream` names one reader (a sampler); each
/// message replaces what the stream hinted before, so hints the reader has passed are dropped.
/// Zero items clears the stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefetchHints {
    pub req_id: u64,
    pub stream: u64,
    pub items: Vec<ReadBlockRequest>,
}

impl PrefetchHints {
    /// Whether `next` can join items whose bodies take `body` bytes (and `count` of them).
    pub fn fits(count: usize, body: usize, next: &ReadBlockRequest) -> bool {
        count < MAX_PREFETCH_ITEMS && 20 + body + next.body_len() <= MAX_PREFETCH_BODY
    }

    pub fn encode(&self) -> Vec<u8> {
        let body_len = 20 + self.items.iter().map(ReadBlockRequest::body_len).sum::<usize>();
        let mut out = Vec::with_capacity(REQUEST_HEADER_LEN + body_len);
        out.extend_from_slice(&request_header(Op::Prefetch, body_len));
        out.extend_from_slice(&self.req_id.to_le_bytes());
        out.extend_from_slice(&self.stream.to_le_bytes());
        out.extend_from_slice(&(self.items.len() as u32).to_le_bytes());
        for item in &self.items {
            item.write_body(&mut out);
        }
        out
    }

    pub fn decode_body(body: &[u8]) -> Result<Self, FrameError> {
        if body.len() > MAX_PREFETCH_BODY {
            return Err(FrameError::BodyTooLarge(body.len()));
        }
        let mut r = Reader { buf: body, pos: 0 };
        let req_id = r.u64()?;
        let stream = r.u64()?;
        let count = r.u32()? as usize;
        if count > MAX_PREFETCH_ITEMS {
            return Err(FrameError::Malformed);
        }
        let mut items = Vec::with_capacity(count);
        for _ in 0..count {
            items.push(ReadBlockRequest::read_from(&mut r)?);
        }
        if r.pos != body.len() {
            return Err(FrameError::Malformed);
        }
        Ok(Self { req_id, stream, items })
    }
}

/// Most blocks one [`HandOffOffer`] names.
pub const MAX_HANDOFF_OFFER_BLOCKS: usize = 1024;
/// Longest encoded [`BlockKey`] a hand-off carries (a file identity is a URI and a path).
pub const MAX_BLOCK_KEY_LEN: usize = 4 + 2 * crate::path::MAX_PATH_LEN + 4 + MAX_VERSION_LEN + 8;
const MAX_HANDOFF_OFFER_BODY: usize = 8 + 4 + MAX_HANDOFF_OFFER_BLOCKS * (4 + MAX_BLOCK_KEY_LEN + 8);

/// Blocks offered to their new owner ([`Op::HandOffOffer`]): each key with its length.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HandOffOffer {
    pub req_id: u64,
    pub blocks: Vec<(crate::BlockKey, u64)>,
}

impl HandOffOffer {
    pub fn encode(&self) -> Vec<u8> {
        let mut body = Vec::new();
        body.extend_from_slice(&self.req_id.to_le_bytes());
        body.extend_from_slice(&(self.blocks.len() as u32).to_le_bytes());
        for (key, len) in &self.blocks {
            let k = key.encode();
            body.extend_from_slice(&(k.len() as u32).to_le_bytes());
            body.extend_from_slice(&k);
            body.extend_from_slice(&len.to_le_bytes());
        }
        let mut out = request_header(Op::HandOffOffer, body.len()).to_vec();
        out.extend_from_slice(&body);
        out
    }

    pub fn decode_body(body: &[u8]) -> Result<Self, FrameError> {
        let mut r = Reader { buf: body, pos: 0 };
        let req_id = r.u64()?;
        let n = r.u32()? as usize;
        if n > MAX_HANDOFF_OFFER_BLOCKS {
            return Err(FrameError::Malformed);
        }
        let mut blocks = Vec::with_capacity(n);
        for _ in 0..n {
            let key = r.key()?;
            blocks.push((key, r.u64()?));
        }
        if r.pos != body.len() {
            return Err(FrameError::Malformed);
        }
        Ok(Self { req_id, blocks })
    }
}

/// One block pushed to its new owner ([`Op::HandOffBlock`]); the body ends with its bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HandOffBlock {
    pub req_id: u64,
    pub key: crate::BlockKey,
    pub data: bytes::Bytes,
}

impl HandOffBlock {
    pub fn encode(&self) -> Vec<u8> {
        let k = self.key.encode();
        let body_len = 8 + 4 + k.len() + self.data.len();
        let mut out = Vec::with_capacity(REQUEST_HEADER_LEN + body_len);
        out.extend_from_slice(&request_header(Op::HandOffBlock, body_len));
        out.extend_from_slice(&self.req_id.to_le_bytes());
        out.extend_from_slice(&(k.len() as u32).to_le_bytes());
        out.extend_from_slice(&k);
        out.extend_from_slice(&self.data);
        out
    }

    pub fn decode_body(body: &[u8]) -> Result<Self, FrameError> {
        let mut r = Reader { buf: body, pos: 0 };
        let req_id = r.u64()?;
        let key = r.key()?;
        let data = bytes::Bytes::copy_from_slice(&body[r.pos..]);
        Ok(Self { req_id, key, data })
    }
}

/// Parses a request header; returns the op and the body length to read next.
pub fn decode_request_header(h: &[u8; REQUEST_HEADER_LEN]) -> Result<(Op, usize), FrameError> {
    let magic: [u8; 4] = h[0..4].try_into().expect("4 bytes");
    if magic != REQUEST_MAGIC {
        return Err(FrameError::BadMagic(magic));
    }
    let op = match h[4] {
        1 => Op::ReadBlock,
        2 => Op::WriteBegin,
        3 => Op::WriteData,
        4 => Op::WriteEnd,
        5 => Op::OpenBlock,
        6 => Op::Release,
        7 => Op::RemoteRead,
        8 => Op::RdmaConnect,
        9 => Op::View,
        10 => Op::Stat,
        11 => Op::Auth,
        12 => Op::PeerRead,
        13 => Op::HandOffOffer,
        14 => Op::HandOffBlock,
        16 => Op::PeerFetch,
        18 => Op::Copy,
        17 => Op::ReadMany,
        19 => Op::Prefetch,
        20 => Op::Class,
        other => return Err(FrameError::UnknownOp(other)),
    };
    let body_len = u32::from_le_bytes(h[8..12].try_into().expect("4 bytes")) as usize;
    let limit = match op {
        Op::WriteData => MAX_WRITE_CHUNK,
        Op::WriteEnd => 1 + MAX_WRITE_HOLDERS * 256,
        Op::Release => LeaseRelease::BODY_LEN,
        Op::RemoteRead => RemoteRead::BODY_LEN,
        Op::RdmaConnect => RdmaEndpoint::ENCODED_LEN,
        Op::View => 8,
        Op::Auth => MAX_AUTH_BODY,
        Op::ReadBlock | Op::Stat | Op::PeerRead | Op::PeerFetch => MAX_REQUEST_BODY,
        // The write-back part and the flags byte are far below a read's fixed fields.
        Op::WriteBegin => MAX_REQUEST_BODY,
        Op::OpenBlock => MAX_REQUEST_BODY + 1,
        Op::HandOffOffer => MAX_HANDOFF_OFFER_BODY,
        Op::HandOffBlock => 8 + 4 + MAX_BLOCK_KEY_LEN + crate::MAX_BLOCK_SIZE as usize,
        Op::Copy => MAX_COPY_BODY,
        Op::ReadMany => MAX_READ_MANY_BODY,
        Op::Prefetch => MAX_PREFETCH_BODY,
        Op::Class => 1,
    };
    if body_len > limit {
        return Err(FrameError::BodyTooLarge(body_len));
    }
    Ok((op, body_len))
}

/// The kind of grant an [`Op::OpenBlock`] asks for (and a [`LeaseRelease`] gives back).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum GrantKind {
    /// A file descriptor passed with the answer (SCM_RIGHTS): short-circuit reads by a client
    /// on the same host. Only a Unix socket can carry it.
    Fd = 1,
    /// A registered memory region the client reads one-sided (RDMA).
    Rdma = 2,
    /// [`Fd`](Self::Fd), but only when it costs the worker no copy: a verified NVMe block
    /// file, or a DRAM block's kept shared-memory copy. Otherwise refused with
    /// `ResourceExhausted`, and the reader reads the bytes another way. Released as `Fd`.
    FdNoCopy = 3,
}

impl GrantKind {
    pub fn from_u8(v: u8) -> Option<Self> {
        match v {
            1 => Some(Self::Fd),
            2 => Some(Self::Rdma),
            3 => Some(Self::FdNoCopy),
            _ => None,
        }
    }

    /// A file descriptor grant (passed over a Unix socket), with or without a copy.
    pub fn is_fd(self) -> bool {
        matches!(self, Self::Fd | Self::FdNoCopy)
    }
}

/// Body of [`Op::OpenBlock`]: a read's body and the kind of grant asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpenBlock {
    pub read: ReadBlockRequest,
    pub kind: GrantKind,
}

impl OpenBlock {
    pub fn encode(&self) -> Vec<u8> {
        self.read.encode_open(self.kind)
    }

    pub fn decode_body(body: &[u8]) -> Result<Self, FrameError> {
        let (&kind, read) = body.split_last().ok_or(FrameError::Malformed)?;
        let kind = GrantKind::from_u8(kind).ok_or(FrameError::Malformed)?;
        Ok(Self { read: ReadBlockRequest::decode_body(read)?, kind })
    }
}

/// How a granted block range is reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GrantHandle {
    /// The file descriptor sent with the response (SCM_RIGHTS) holds the range at `offset`:
    /// an NVMe block file or a shared-memory (memfd) copy of a DRAM block.
    Fd { offset: u64 },
    /// Registered worker memory: an RDMA READ of `len` bytes at `addr` with `rkey`.
    Rdma { addr: u64, rkey: u32 },
}

/// The answer to [`Op::OpenBlock`]: where the requested range is and the lease that keeps it
/// there. Until the lease ends (released, or `ttl_ms` after the grant) the worker neither
/// reuses nor frees what the handle names, so eviction cannot pull the bytes from under a reader.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockGrant {
    pub lease_id: u64,
    pub ttl_ms: u64,
    /// Bytes of the range (the request's `len`).
    pub len: u64,
    pub handle: GrantHandle,
}

impl BlockGrant {
    pub const ENCODED_LEN: usize = 40;

    pub fn encode(&self) -> [u8; Self::ENCODED_LEN] {
        let mut out = [0u8; Self::ENCODED_LEN];
        let (kind, a, b) = match self.handle {
            GrantHandle::Fd { offset } => (1u8, offset, 0u32),
            GrantHandle::Rdma { addr, rkey } => (2u8, addr, rkey),
        };
        out[0] = kind;
        out[4..8].copy_from_slice(&b.to_le_bytes());
        out[8..16].copy_from_slice(&self.lease_id.to_le_bytes());
        out[16..24].copy_from_slice(&self.ttl_ms.to_le_bytes());
        out[24..32].copy_from_slice(&self.len.to_le_bytes());
        out[32..40].copy_from_slice(&a.to_le_bytes());
        out
    }

    pub fn decode(buf: &[u8]) -> Result<Self, FrameError> {
        if buf.len() != Self::ENCODED_LEN || buf[1..4] != [0, 0, 0] {
            return Err(FrameError::Malformed);
        }
        let u64_at = |i: usize| u64::from_le_bytes(buf[i..i + 8].try_into().expect("8 bytes"));
        let b = u32::from_le_bytes(buf[4..8].try_into().expect("4 bytes"));
        let handle = match buf[0] {
            1 if b == 0 => GrantHandle::Fd { offset: u64_at(32) },
            2 => GrantHandle::Rdma { addr: u64_at(32), rkey: b },
            _ => return Err(FrameError::Malformed),
        };
        Ok(Self { lease_id: u64_at(8), ttl_ms: u64_at(16), len: u64_at(24), handle })
    }
}

/// Body of [`Op::Release`]: the lease given back, and the kind of grant it held (each kind has
/// its own lease table).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseRelease {
    pub lease_id: u64,
    pub kind: GrantKind,
}

impl LeaseRelease {
    pub const BODY_LEN: usize = 9;

    pub fn encode(&self) -> Vec<u8> {
        let mut out = request_header(Op::Release, Self::BODY_LEN).to_vec();
        out.extend_from_slice(&self.lease_id.to_le_bytes());
        out.push(self.kind as u8);
        out
    }

    pub fn decode_body(body: &[u8]) -> Result<Self, FrameError> {
        let body: &[u8; Self::BODY_LEN] = body.try_into().map_err(|_| FrameError::Malformed)?;
        let lease_id = u64::from_le_bytes(body[..8].try_into().expect("8 bytes"));
        let kind = GrantKind::from_u8(body[8]).ok_or(FrameError::Malformed)?;
        Ok(Self { lease_id, kind })
    }
}

/// Body of [`Op::RemoteRead`]: `len` bytes at `addr` of the region `rkey` names. The response
/// is a data response of exactly `len` bytes, or an error frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteRead {
    pub req_id: u64,
    pub addr: u64,
    pub rkey: u32,
    pub len: u64,
}

impl RemoteRead {
    pub const BODY_LEN: usize = 28;

    pub fn encode(&self) -> Vec<u8> {
        let mut out = request_header(Op::RemoteRead, Self::BODY_LEN).to_vec();
        out.extend_from_slice(&self.req_id.to_le_bytes());
        out.extend_from_slice(&self.addr.to_le_bytes());
        out.extend_from_slice(&self.rkey.to_le_bytes());
        out.extend_from_slice(&self.len.to_le_bytes());
        out
    }

    pub fn decode_body(body: &[u8]) -> Result<Self, FrameError> {
        if body.len() != Self::BODY_LEN {
            return Err(FrameError::Malformed);
        }
        let u64_at = |i: usize| u64::from_le_bytes(body[i..i + 8].try_into().expect("8 bytes"));
        Ok(Self {
            req_id: u64_at(0),
            addr: u64_at(8),
            rkey: u32::from_le_bytes(body[16..20].try_into().expect("4 bytes")),
            len: u64_at(20),
        })
    }
}

/// An RDMA queue pair's address, exchanged in [`Op::RdmaConnect`] to connect a reliable
/// connection (RC) between a client and a worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RdmaEndpoint {
    pub qp_num: u32,
    /// The port's local id (InfiniBand); 0 on RoCE.
    pub lid: u16,
    /// The port's global id, for routed (RoCE) connections.
    pub gid: Option<[u8; 16]>,
}

impl RdmaEndpoint {
    pub const ENCODED_LEN: usize = 24;

    /// `qp_num:u32 lid:u16 has_gid:u8 0:u8 gid:[u8;16]`.
    pub fn encode(&self) -> [u8; Self::ENCODED_LEN] {
        let mut out = [0u8; Self::ENCODED_LEN];
        out[0..4].copy_from_slice(&self.qp_num.to_le_bytes());
        out[4..6].copy_from_slice(&self.lid.to_le_bytes());
        if let Some(gid) = self.gid {
            out[6] = 1;
            out[8..24].copy_from_slice(&gid);
        }
        out
    }

    /// The request frame of [`Op::RdmaConnect`].
    pub fn encode_request(&self) -> Vec<u8> {
        let mut out = request_header(Op::RdmaConnect, Self::ENCODED_LEN).to_vec();
        out.extend_from_slice(&self.encode());
        out
    }

    pub fn decode(buf: &[u8]) -> Result<Self, FrameError> {
        if buf.len() != Self::ENCODED_LEN || buf[6] > 1 || buf[7] != 0 {
            return Err(FrameError::Malformed);
        }
        let gid: [u8; 16] = buf[8..24].try_into().expect("16 bytes");
        if buf[6] == 0 && gid != [0; 16] {
            return Err(FrameError::Malformed);
        }
        Ok(Self {
            qp_num: u32::from_le_bytes(buf[0..4].try_into().expect("4 bytes")),
            lid: u16::from_le_bytes(buf[4..6].try_into().expect("2 bytes")),
            gid: (buf[6] == 1).then_some(gid),
        })
    }
}

/// A request whose body is its id and one path (`WriteBegin`, `Stat`).
fn encode_path_request(op: Op, req_id: u64, path: &str) -> Vec<u8> {
    let mut out = request_header(op, 8 + 2 + path.len()).to_vec();
    out.extend_from_slice(&req_id.to_le_bytes());
    out.extend_from_slice(&(path.len() as u16).to_le_bytes());
    out.extend_from_slice(path.as_bytes());
    out
}

fn decode_path_body(body: &[u8]) -> Result<(u64, String), FrameError> {
    let mut r = Reader { buf: body, pos: 0 };
    let req_id = r.u64()?;
    let path = r.string()?;
    if r.pos != body.len() {
        return Err(FrameError::Malformed);
    }
    Ok((req_id, path))
}

/// The first frame of a write: which file to replace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WriteBegin {
    pub req_id: u64,
    /// Strata path of the file (normalised, absolute).
    pub path: String,
    /// On a write-back mount: which write this stream is a copy of, and which copy.
    pub write_back: Option<WriteBackCopy>,
}

/// One copy of a write-back write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WriteBackCopy {
    /// Chosen by the client, the same on every copy (at most 255 bytes; ASCII).
    pub write_id: String,
    /// 0 for the primary (it commits the write with the master), 1.. for the replicas.
    pub rank: u8,
}

/// Longest write id.
pub const MAX_WRITE_ID: usize = 64;

/// How a write treats the file it names (the optional last byte of a `WriteBegin` body).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WriteFlags {
    /// The bytes written go after the file's (which is made empty if absent) instead of
    /// replacing it; the result still appears only when the write commits.
    pub append: bool,
}

impl WriteFlags {
    const APPEND: u8 = 1;

    fn encode(self) -> u8 {
        if self.append { Self::APPEND } else { 0 }
    }

    fn decode(b: u8) -> Result<Self, FrameError> {
        if b & !Self::APPEND != 0 {
            return Err(FrameError::Malformed);
        }
        Ok(Self { append: b & Self::APPEND != 0 })
    }
}

impl WriteBegin {
    pub fn encode(&self) -> Vec<u8> {
        self.encode_with(WriteFlags::default())
    }

    /// The frame with `flags`; with none set it is the frame [`encode`](Self::encode) writes,
    /// which every worker reads.
    pub fn encode_with(&self, flags: WriteFlags) -> Vec<u8> {
        let mut out = encode_path_request(Op::WriteBegin, self.req_id, &self.path);
        let flagged = flags != WriteFlags::default();
        match &self.write_back {
            Some(copy) => {
                let id = &copy.write_id.as_bytes()[..copy.write_id.len().min(MAX_WRITE_ID)];
                out.push(id.len() as u8);
                out.extend_from_slice(id);
                out.push(copy.rank);
            }
            None if flagged => out.push(0),
            None => {}
        }
        if flagged {
            out.push(flags.encode());
        }
        let body_len = (out.len() - REQUEST_HEADER_LEN) as u32;
        out[8..12].copy_from_slice(&body_len.to_le_bytes());
        out
    }

    /// A body without flags (a body that sets any is malformed here: use [`decode`](Self::decode),
    /// so no flag is ever dropped unread).
    pub fn decode_body(body: &[u8]) -> Result<Self, FrameError> {
        match Self::decode(body)? {
            (begin, flags) if flags == WriteFlags::default() => Ok(begin),
            _ => Err(FrameError::Malformed),
        }
    }

    /// A body and its flags.
    pub fn decode(body: &[u8]) -> Result<(Self, WriteFlags), FrameError> {
        let mut r = Reader { buf: body, pos: 0 };
        let req_id = r.u64()?;
        let path = r.string()?;
        let mut write_back = None;
        let mut flags = WriteFlags::default();
        if r.pos != body.len() {
            let id = r.bytes_u8()?.to_vec();
            if id.is_empty() {
                // Not a write-back copy: the flags follow.
                flags = WriteFlags::decode(r.u8()?)?;
            } else {
                let write_id = String::from_utf8(id).map_err(|_| FrameError::NotUtf8)?;
                if write_id.len() > MAX_WRITE_ID
                    || !write_id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
                {
                    return Err(FrameError::Malformed);
                }
                let rank = r.u8()?;
                write_back = Some(WriteBackCopy { write_id, rank });
                if r.pos != body.len() {
                    flags = WriteFlags::decode(r.u8()?)?;
                }
            }
        }
        if r.pos != body.len() {
            return Err(FrameError::Malformed);
        }
        Ok((Self { req_id, path, write_back }, flags))
    }
}

/// Largest `Copy` body: two maximal paths and a maximal version.
pub const MAX_COPY_BODY: usize =
    8 + 2 + crate::path::MAX_PATH_LEN + 2 + crate::path::MAX_PATH_LEN + 2 + MAX_VERSION_LEN + 8;

/// Body of [`Op::Copy`]: make `dst` a copy of the file `src` (both Strata paths, normalised).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CopyRequest {
    pub req_id: u64,
    pub src: String,
    pub dst: String,
    /// A write-back version of `src` not yet in the UFS, with its `size` (the client's stat);
    /// empty (and `size` 0) for every other file: the worker takes the UFS's current version.
    pub version: String,
    pub size: u64,
}

impl CopyRequest {
    pub fn encode(&self) -> Vec<u8> {
        let strings = [&self.src, &self.dst, &self.version];
        let body_len = 8 + strings.iter().map(|s| 2 + s.len()).sum::<usize>() + 8;
        let mut out = Vec::with_capacity(REQUEST_HEADER_LEN + body_len);
        out.extend_from_slice(&request_header(Op::Copy, body_len));
        out.extend_from_slice(&self.req_id.to_le_bytes());
        for s in strings {
            out.extend_from_slice(&(s.len() as u16).to_le_bytes());
            out.extend_from_slice(s.as_bytes());
        }
        out.extend_from_slice(&self.size.to_le_bytes());
        out
    }

    pub fn decode_body(body: &[u8]) -> Result<Self, FrameError> {
        let mut r = Reader { buf: body, pos: 0 };
        let req_id = r.u64()?;
        let src = r.string()?;
        let dst = r.string()?;
        let version = r.string()?;
        let size = r.u64()?;
        if r.pos != body.len()
            || src.len() > crate::path::MAX_PATH_LEN
            || dst.len() > crate::path::MAX_PATH_LEN
        {
            return Err(FrameError::Malformed);
        }
        if version.len() > MAX_VERSION_LEN || (version.is_empty() && size != 0) {
            return Err(FrameError::Malformed);
        }
        Ok(Self { req_id, src, dst, version, size })
    }
}

/// How a worker made a copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum CopyVia {
    /// The UFS copied the object itself (S3 CopyObject, a local file copy): no byte of it
    /// passed through the worker.
    Ufs = 1,
    /// The worker read the source's blocks through its cache (cached blocks not read from the
    /// UFS again) and wrote them to the destination.
    Streamed = 2,
}

/// The payload of a successful `Copy` answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyAnswer {
    pub via: CopyVia,
    /// The size of the copy.
    pub bytes: u64,
}

impl CopyAnswer {
    pub const ENCODED_LEN: usize = 9;

    pub fn encode(&self) -> [u8; Self::ENCODED_LEN] {
        let mut out = [0u8; Self::ENCODED_LEN];
        out[0] = self.via as u8;
        out[1..].copy_from_slice(&self.bytes.to_le_bytes());
        out
    }

    pub fn decode(buf: &[u8]) -> Result<Self, FrameError> {
        let buf: &[u8; Self::ENCODED_LEN] = buf.try_into().map_err(|_| FrameError::Malformed)?;
        let via = match buf[0] {
            1 => CopyVia::Ufs,
            2 => CopyVia::Streamed,
            _ => return Err(FrameError::Malformed),
        };
        Ok(Self { via, bytes: u64::from_le_bytes(buf[1..].try_into().expect("8 bytes")) })
    }
}

/// Most replicas a primary's `WriteEnd` names.
pub const MAX_WRITE_HOLDERS: usize = 16;

/// The `WriteEnd` frame: empty, or (to a write-back primary) the worker ids of the replicas
/// whose journals hold the file.
pub fn write_end(holders: &[String]) -> Vec<u8> {
    let mut body = Vec::new();
    if !holders.is_empty() {
        body.push(holders.len().min(MAX_WRITE_HOLDERS) as u8);
        for h in holders.iter().take(MAX_WRITE_HOLDERS) {
            let id = &h.as_bytes()[..h.len().min(255)];
            body.push(id.len() as u8);
            body.extend_from_slice(id);
        }
    }
    let mut out = request_header(Op::WriteEnd, body.len()).to_vec();
    out.extend_from_slice(&body);
    out
}

/// The replicas a `WriteEnd` body names.
pub fn decode_write_end(body: &[u8]) -> Result<Vec<String>, FrameError> {
    if body.is_empty() {
        return Ok(Vec::new());
    }
    let mut r = Reader { buf: body, pos: 0 };
    let n = r.u8()? as usize;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let id = r.bytes_u8()?;
        out.push(std::str::from_utf8(id).map_err(|_| FrameError::NotUtf8)?.to_string());
    }
    if r.pos != body.len() {
        return Err(FrameError::Malformed);
    }
    Ok(out)
}

/// The `Class` frame declaring `class` for a connection's later requests.
pub fn class_request(class: QosClass) -> Vec<u8> {
    let mut out = request_header(Op::Class, 1).to_vec();
    out.push(class as u8);
    out
}

/// The class of a `Class` body.
pub fn decode_class_body(body: &[u8]) -> Result<QosClass, FrameError> {
    match body {
        [v] => QosClass::from_u8(*v).ok_or(FrameError::Malformed),
        _ => Err(FrameError::Malformed),
    }
}

/// Largest `Auth` body (a token).
pub const MAX_AUTH_BODY: usize = 512;

/// The `Auth` frame presenting `token` (at most [`MAX_AUTH_BODY`] bytes; a longer one is cut and
/// so refused).
pub fn auth_request(token: &str) -> Vec<u8> {
    let token = &token.as_bytes()[..token.len().min(MAX_AUTH_BODY)];
    let mut out = request_header(Op::Auth, token.len()).to_vec();
    out.extend_from_slice(token);
    out
}

/// The token of an `Auth` body.
pub fn decode_auth_body(body: &[u8]) -> Result<&str, FrameError> {
    std::str::from_utf8(body).map_err(|_| FrameError::NotUtf8)
}

/// A `View` request: the worker's last view of the cluster.
pub fn view_request(req_id: u64) -> Vec<u8> {
    let mut out = request_header(Op::View, 8).to_vec();
    out.extend_from_slice(&req_id.to_le_bytes());
    out
}

/// The request id of a `View` body.
pub fn decode_view_body(body: &[u8]) -> Result<u64, FrameError> {
    let body: [u8; 8] = body.try_into().map_err(|_| FrameError::Malformed)?;
    Ok(u64::from_le_bytes(body))
}

/// A `Stat` request: the metadata of one Strata path, from the UFS through the worker's mount.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StatRequest {
    pub req_id: u64,
    /// Strata path (normalised, absolute).
    pub path: String,
}

impl StatRequest {
    pub fn encode(&self) -> Vec<u8> {
        encode_path_request(Op::Stat, self.req_id, &self.path)
    }

    pub fn decode_body(body: &[u8]) -> Result<Self, FrameError> {
        let (req_id, path) = decode_path_body(body)?;
        Ok(Self { req_id, path })
    }
}

/// The answer to a `Stat`: what the master's `Stat` answers, computed the same way (version from
/// the UFS, `file_id` from the mount's URI, the path under it and the block size).
/// `is_dir:u8 size:u64 mtime_ms:u64 block_size:u64 path version file_id` (strings as
/// `len:u16 bytes`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileStat {
    pub path: String,
    pub is_dir: bool,
    pub size: u64,
    pub version: String,
    pub mtime_ms: i64,
    pub block_size: u64,
    pub file_id: String,
}

impl FileStat {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(25 + 6 + self.path.len() + self.version.len() + self.file_id.len());
        out.push(u8::from(self.is_dir));
        out.extend_from_slice(&self.size.to_le_bytes());
        out.extend_from_slice(&self.mtime_ms.to_le_bytes());
        out.extend_from_slice(&self.block_size.to_le_bytes());
        for s in [&self.path, &self.version, &self.file_id] {
            out.extend_from_slice(&(s.len().min(u16::MAX as usize) as u16).to_le_bytes());
            out.extend_from_slice(&s.as_bytes()[..s.len().min(u16::MAX as usize)]);
        }
        out
    }

    pub fn decode(buf: &[u8]) -> Result<Self, FrameError> {
        let mut r = Reader { buf, pos: 0 };
        let is_dir = match r.take(1)?[0] {
            0 => false,
            1 => true,
            _ => return Err(FrameError::Malformed),
        };
        let size = r.u64()?;
        let mtime_ms = r.u64()? as i64;
        let block_size = r.u64()?;
        let path = r.string()?;
        let version = r.string()?;
        let file_id = r.string()?;
        if r.pos != buf.len() {
            return Err(FrameError::Malformed);
        }
        Ok(Self { path, is_dir, size, version, mtime_ms, block_size, file_id })
    }
}

/// The header of a request frame whose body (of `body_len` bytes) follows; `WriteData` and
/// `WriteEnd` frames are this header alone plus the raw bytes.
pub fn request_header(op: Op, body_len: usize) -> [u8; REQUEST_HEADER_LEN] {
    let mut h = [0u8; REQUEST_HEADER_LEN];
    h[0..4].copy_from_slice(&REQUEST_MAGIC);
    h[4] = op as u8;
    h[8..12].copy_from_slice(&(body_len as u32).to_le_bytes());
    h
}

/// A decoded response header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResponseHeader {
    /// `Ok(source)` for data, `Err(kind)` for an error frame.
    pub status: Result<Source, ErrorKind>,
    pub req_id: u64,
    pub payload_len: u64,
}

impl ResponseHeader {
    pub fn encode(&self) -> [u8; RESPONSE_HEADER_LEN] {
        let mut out = [0u8; RESPONSE_HEADER_LEN];
        out[0..4].copy_from_slice(&RESPONSE_MAGIC);
        match self.status {
            Ok(source) => out[5] = source as u8,
            Err(kind) => out[4] = kind as u8,
        }
        out[8..16].copy_from_slice(&self.req_id.to_le_bytes());
        out[16..24].copy_from_slice(&self.payload_len.to_le_bytes());
        out
    }

    pub fn decode(h: &[u8; RESPONSE_HEADER_LEN]) -> Result<Self, FrameError> {
        let magic: [u8; 4] = h[0..4].try_into().expect("4 bytes");
        if magic != RESPONSE_MAGIC {
            return Err(FrameError::BadMagic(magic));
        }
        let status = match h[4] {
            0 => Ok(Source::from_u8(h[5]).ok_or(FrameError::Malformed)?),
            // A kind added by a newer worker: still an error answer, with its message, and the
            // connection stays in step.
            code => Err(ErrorKind::from_u8(code).unwrap_or(ErrorKind::Internal)),
        };
        Ok(Self {
            status,
            req_id: u64::from_le_bytes(h[8..16].try_into().expect("8 bytes")),
            payload_len: u64::from_le_bytes(h[16..24].try_into().expect("8 bytes")),
        })
    }
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], FrameError> {
        let end = self.pos.checked_add(n).ok_or(FrameError::Malformed)?;
        let s = self.buf.get(self.pos..end).ok_or(FrameError::Malformed)?;
        self.pos = end;
        Ok(s)
    }
    fn u64(&mut self) -> Result<u64, FrameError> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8 bytes")))
    }
    fn u32(&mut self) -> Result<u32, FrameError> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4 bytes")))
    }
    /// `len:u32` then a [`BlockKey`] as [`BlockKey::encode`] writes it.
    fn key(&mut self) -> Result<crate::BlockKey, FrameError> {
        let len = self.u32()? as usize;
        if len > MAX_BLOCK_KEY_LEN {
            return Err(FrameError::Malformed);
        }
        let raw = self.take(len)?;
        match crate::BlockKey::decode(raw) {
            Some((key, used)) if used == raw.len() => Ok(key),
            _ => Err(FrameError::Malformed),
        }
    }
    fn u8(&mut self) -> Result<u8, FrameError> {
        Ok(self.take(1)?[0])
    }
    /// `len:u8` then that many bytes.
    fn bytes_u8(&mut self) -> Result<&[u8], FrameError> {
        let len = self.u8()? as usize;
        self.take(len)
    }
    fn string(&mut self) -> Result<String, FrameError> {
        let len = u16::from_le_bytes(self.take(2)?.try_into().expect("2 bytes")) as usize;
        let bytes = self.take(len)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| FrameError::NotUtf8)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hand_off_frames_round_trip_and_reject_a_trailing_byte() {
        let key = crate::BlockKey::new("file:///u/a#bs4", "v1", 3);
        let offer = HandOffOffer {
            req_id: 9,
            blocks: vec![(key.clone(), 4), (crate::BlockKey::new("x", "v", 0), 1)],
        };
        let frame = offer.encode();
        let (op, len) = decode_request_header(frame[..REQUEST_HEADER_LEN].try_into().unwrap()).unwrap();
        assert_eq!((op, len), (Op::HandOffOffer, frame.len() - REQUEST_HEADER_LEN));
        assert_eq!(HandOffOffer::decode_body(&frame[REQUEST_HEADER_LEN..]).unwrap(), offer);
        let mut longer = frame[REQUEST_HEADER_LEN..].to_vec();
        longer.push(0);
        assert_eq!(HandOffOffer::decode_body(&longer), Err(FrameError::Malformed));

        let block = HandOffBlock { req_id: 2, key, data: bytes::Bytes::from_static(b"abcd") };
        let frame = block.encode();
        let (op, _) = decode_request_header(frame[..REQUEST_HEADER_LEN].try_into().unwrap()).unwrap();
        assert_eq!(op, Op::HandOffBlock);
        assert_eq!(HandOffBlock::decode_body(&frame[REQUEST_HEADER_LEN..]).unwrap(), block);
    }
    use proptest::prelude::*;

    #[test]
    fn write_back_frames_round_trip() {
        let plain = WriteBegin { req_id: 3, path: "/w/a".into(), write_back: None };
        let encoded = plain.encode();
        assert_eq!(WriteBegin::decode_body(&encoded[REQUEST_HEADER_LEN..]).unwrap(), plain);
        let copy = WriteBackCopy { write_id: "0af3-9".into(), rank: 1 };
        let wb = WriteBegin { req_id: 4, path: "/w/b".into(), write_back: Some(copy) };
        let encoded = wb.encode();
        let (op, len) = decode_request_header(encoded[..REQUEST_HEADER_LEN].try_into().unwrap()).unwrap();
        assert_eq!((op, len), (Op::WriteBegin, encoded.len() - REQUEST_HEADER_LEN));
        assert_eq!(WriteBegin::decode_body(&encoded[REQUEST_HEADER_LEN..]).unwrap(), wb);
        // A write id that could name a file outside the journal directory is refused.
        let mut bad = encode_path_request(Op::WriteBegin, 1, "/w/c")[REQUEST_HEADER_LEN..].to_vec();
        bad.extend_from_slice(&[5, b'.', b'.', b'/', b'x', b'y', 0]);
        assert!(WriteBegin::decode_body(&bad).is_err());
        let holders = vec!["worker-a".to_string(), "worker-b".to_string()];
        let end = write_end(&holders);
        let (op, len) = decode_request_header(end[..REQUEST_HEADER_LEN].try_into().unwrap()).unwrap();
        assert_eq!((op, len), (Op::WriteEnd, end.len() - REQUEST_HEADER_LEN));
        assert_eq!(decode_write_end(&end[REQUEST_HEADER_LEN..]).unwrap(), holders);
        assert!(decode_write_end(&[]).unwrap().is_empty());
        assert!(decode_write_end(&[2, 1, b'a']).is_err());
    }

    #[test]
    fn auth_frames_round_trip_and_are_bounded() {
        let frame = auth_request("strata_abc");
        let header: [u8; REQUEST_HEADER_LEN] = frame[..REQUEST_HEADER_LEN].try_into().unwrap();
        assert_eq!(decode_request_header(&header).unwrap(), (Op::Auth, 10));
        assert_eq!(decode_auth_body(&frame[REQUEST_HEADER_LEN..]), Ok("strata_abc"));
        assert_eq!(decode_auth_body(&[0xff, 0xfe]), Err(FrameError::NotUtf8));
        assert!(decode_request_header(&request_header(Op::Auth, MAX_AUTH_BODY + 1)).is_err());
        let long = auth_request(&"x".repeat(MAX_AUTH_BODY * 2));
        assert_eq!(long.len(), REQUEST_HEADER_LEN + MAX_AUTH_BODY);
    }

    #[test]
    fn class_frames_round_trip_and_refuse_unknown_classes() {
        for class in QosClass::ALL {
            let frame = class_request(class);
            let header: [u8; REQUEST_HEADER_LEN] = frame[..REQUEST_HEADER_LEN].try_into().unwrap();
            assert_eq!(decode_request_header(&header).unwrap(), (Op::Class, 1));
            assert_eq!(decode_class_body(&frame[REQUEST_HEADER_LEN..]), Ok(class));
        }
        assert_eq!(decode_class_body(&[3]), Err(FrameError::Malformed));
        assert_eq!(decode_class_body(&[]), Err(FrameError::Malformed));
        assert!(decode_request_header(&request_header(Op::Class, 2)).is_err());
    }

    #[test]
    fn view_and_stat_requests_round_trip() {
        let view = view_request(42);
        let header: [u8; REQUEST_HEADER_LEN] = view[..REQUEST_HEADER_LEN].try_into().unwrap();
        assert_eq!(decode_request_header(&header).unwrap(), (Op::View, 8));
        assert_eq!(decode_view_body(&view[REQUEST_HEADER_LEN..]), Ok(42));
        assert!(decode_view_body(&[0; 7]).is_err());
        assert!(decode_request_header(&request_header(Op::View, 9)).is_err());

        let stat = StatRequest { req_id: 3, path: "/data/ü".into() };
        let enc = stat.encode();
        let header: [u8; REQUEST_HEADER_LEN] = enc[..REQUEST_HEADER_LEN].try_into().unwrap();
        assert_eq!(decode_request_header(&header).unwrap(), (Op::Stat, enc.len() - REQUEST_HEADER_LEN));
        assert_eq!(StatRequest::decode_body(&enc[REQUEST_HEADER_LEN..]), Ok(stat));
        assert!(StatRequest::decode_body(&enc[REQUEST_HEADER_LEN..enc.len() - 1]).is_err());

        let answer = FileStat {
            path: "/data/x".into(),
            is_dir: false,
            size: 10,
            version: "\"e\"".into(),
            mtime_ms: -5,
            block_size: 4,
            file_id: "file:///u/x#bs4".into(),
        };
        assert_eq!(FileStat::decode(&answer.encode()), Ok(answer.clone()));
        let mut bad = answer.encode();
        bad[0] = 2;
        assert_eq!(FileStat::decode(&bad), Err(FrameError::Malformed));
        assert!(FileStat::decode(&answer.encode()[..20]).is_err());
    }

    proptest! {
        #[test]
        fn arbitrary_stat_answers_never_panic(buf in proptest::collection::vec(any::<u8>(), 0..128)) {
            let _ = FileStat::decode(&buf);
        }
    }

    fn sample() -> ReadBlockRequest {
        ReadBlockRequest {
            req_id: 9,
            path: "/data/ü x".into(),
            version: "\"etag\"".into(),
            file_size: 100,
            block_size: 10,
            block_index: 3,
            offset: 2,
            len: 5,
        }
    }

    #[test]
    fn request_round_trips() {
        let enc = sample().encode();
        let header: [u8; REQUEST_HEADER_LEN] = enc[..REQUEST_HEADER_LEN].try_into().unwrap();
        let (op, len) = decode_request_header(&header).unwrap();
        assert_eq!(op, Op::ReadBlock);
        assert_eq!(len, enc.len() - REQUEST_HEADER_LEN);
        assert_eq!(ReadBlockRequest::decode_body(&enc[REQUEST_HEADER_LEN..]).unwrap(), sample());
    }

    #[test]
    fn bad_headers_are_rejected() {
        let mut h = [0u8; REQUEST_HEADER_LEN];
        h[..4].copy_from_slice(b"GET ");
        assert!(matches!(decode_request_header(&h), Err(FrameError::BadMagic(_))));
        h[..4].copy_from_slice(&REQUEST_MAGIC);
        h[4] = 77;
        assert_eq!(decode_request_header(&h), Err(FrameError::UnknownOp(77)));
        h[4] = 1;
        h[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(decode_request_header(&h), Err(FrameError::BodyTooLarge(_))));
    }

    #[test]
    fn response_header_round_trips() {
        for status in [Ok(Source::Nvme), Err(ErrorKind::VersionChanged)] {
            let h = ResponseHeader { status, req_id: 5, payload_len: 77 };
            assert_eq!(ResponseHeader::decode(&h.encode()).unwrap(), h);
        }
        let mut newer =
            ResponseHeader { status: Err(ErrorKind::NotFound), req_id: 5, payload_len: 7 }.encode();
        newer[4] = 200;
        let decoded = ResponseHeader::decode(&newer).unwrap();
        assert_eq!(
            decoded.status,
            Err(ErrorKind::Internal),
            "an unknown kind is an error, not a broken frame"
        );
        assert_eq!(decoded.payload_len, 7);
    }

    #[test]
    fn write_frames_round_trip() {
        let begin = WriteBegin { req_id: 3, path: "/data/ü.bin".into(), write_back: None };
        let enc = begin.encode();
        let header: [u8; REQUEST_HEADER_LEN] = enc[..REQUEST_HEADER_LEN].try_into().unwrap();
        assert_eq!(decode_request_header(&header).unwrap(), (Op::WriteBegin, enc.len() - REQUEST_HEADER_LEN));
        assert_eq!(WriteBegin::decode_body(&enc[REQUEST_HEADER_LEN..]).unwrap(), begin);
        let data = request_header(Op::WriteData, MAX_WRITE_CHUNK);
        assert_eq!(decode_request_header(&data).unwrap(), (Op::WriteData, MAX_WRITE_CHUNK));
        let too_big = request_header(Op::WriteData, MAX_WRITE_CHUNK + 1);
        assert!(matches!(decode_request_header(&too_big), Err(FrameError::BodyTooLarge(_))));
        // A data-sized body is refused on any other op.
        let big_begin = request_header(Op::WriteBegin, MAX_WRITE_CHUNK);
        assert!(matches!(decode_request_header(&big_begin), Err(FrameError::BodyTooLarge(_))));
        let too_long_end = 2 + MAX_WRITE_HOLDERS * 256;
        assert!(matches!(
            decode_request_header(&request_header(Op::WriteEnd, too_long_end)),
            Err(FrameError::BodyTooLarge(_))
        ));
    }

    #[test]
    fn grant_and_lease_frames_round_trip() {
        for handle in
            [GrantHandle::Fd { offset: 4096 + 77 }, GrantHandle::Rdma { addr: 0x7f00_0000_1000, rkey: 42 }]
        {
            let g = BlockGrant { lease_id: 9, ttl_ms: 30_000, len: 1 << 22, handle };
            assert_eq!(BlockGrant::decode(&g.encode()).unwrap(), g);
        }
        let mut bad =
            BlockGrant { lease_id: 1, ttl_ms: 1, len: 1, handle: GrantHandle::Fd { offset: 0 } }.encode();
        bad[0] = 9;
        assert_eq!(BlockGrant::decode(&bad), Err(FrameError::Malformed));
        assert_eq!(BlockGrant::decode(&bad[..10]), Err(FrameError::Malformed));

        for kind in [GrantKind::Fd, GrantKind::Rdma, GrantKind::FdNoCopy] {
            let rel = LeaseRelease { lease_id: 77, kind }.encode();
            let header: [u8; REQUEST_HEADER_LEN] = rel[..REQUEST_HEADER_LEN].try_into().unwrap();
            assert_eq!(decode_request_header(&header).unwrap(), (Op::Release, LeaseRelease::BODY_LEN));
            assert_eq!(
                LeaseRelease::decode_body(&rel[REQUEST_HEADER_LEN..]).unwrap(),
                LeaseRelease { lease_id: 77, kind }
            );
        }
        let mut bad_kind = LeaseRelease { lease_id: 1, kind: GrantKind::Fd }.encode();
        *bad_kind.last_mut().unwrap() = 4;
        assert_eq!(LeaseRelease::decode_body(&bad_kind[REQUEST_HEADER_LEN..]), Err(FrameError::Malformed));

        let rr = RemoteRead { req_id: 3, addr: 1 << 40, rkey: 7, len: 4096 };
        let enc = rr.encode();
        let header: [u8; REQUEST_HEADER_LEN] = enc[..REQUEST_HEADER_LEN].try_into().unwrap();
        assert_eq!(decode_request_header(&header).unwrap(), (Op::RemoteRead, RemoteRead::BODY_LEN));
        assert_eq!(RemoteRead::decode_body(&enc[REQUEST_HEADER_LEN..]).unwrap(), rr);
        assert!(decode_request_header(&request_header(Op::Release, 10)).is_err());

        for kind in [GrantKind::Fd, GrantKind::Rdma, GrantKind::FdNoCopy] {
            let open = OpenBlock { read: sample(), kind }.encode();
            let header: [u8; REQUEST_HEADER_LEN] = open[..REQUEST_HEADER_LEN].try_into().unwrap();
            assert_eq!(
                decode_request_header(&header).unwrap(),
                (Op::OpenBlock, open.len() - REQUEST_HEADER_LEN)
            );
            assert_eq!(
                OpenBlock::decode_body(&open[REQUEST_HEADER_LEN..]).unwrap(),
                OpenBlock { read: sample(), kind }
            );
        }
        // A read's body without a kind, or with an unknown one, is malformed.
        let read = sample().encode();
        assert_eq!(OpenBlock::decode_body(&read[REQUEST_HEADER_LEN..]), Err(FrameError::Malformed));
        let mut unknown = sample().encode_open(GrantKind::Fd);
        *unknown.last_mut().unwrap() = 0;
        assert_eq!(OpenBlock::decode_body(&unknown[REQUEST_HEADER_LEN..]), Err(FrameError::Malformed));
    }

    #[test]
    fn rdma_endpoints_round_trip_and_bad_ones_fail() {
        for ep in [
            RdmaEndpoint { qp_num: 0x00ab_cdef, lid: 17, gid: None },
            RdmaEndpoint { qp_num: 1, lid: 0, gid: Some([0xfe; 16]) },
        ] {
            let req = ep.encode_request();
            let header: [u8; REQUEST_HEADER_LEN] = req[..REQUEST_HEADER_LEN].try_into().unwrap();
            assert_eq!(decode_request_header(&header).unwrap(), (Op::RdmaConnect, RdmaEndpoint::ENCODED_LEN));
            assert_eq!(RdmaEndpoint::decode(&req[REQUEST_HEADER_LEN..]).unwrap(), ep);
        }
        let mut bad = RdmaEndpoint { qp_num: 1, lid: 1, gid: None }.encode();
        bad[20] = 1; // gid bytes without the gid flag
        assert_eq!(RdmaEndpoint::decode(&bad), Err(FrameError::Malformed));
        bad[6] = 2;
        assert_eq!(RdmaEndpoint::decode(&bad), Err(FrameError::Malformed));
        assert_eq!(RdmaEndpoint::decode(&bad[..23]), Err(FrameError::Malformed));
        assert!(decode_request_header(&request_header(Op::RdmaConnect, 25)).is_err());
    }

    #[test]
    fn write_flags_round_trip_and_old_bodies_still_read() {
        let plain = WriteBegin { req_id: 3, path: "/w/a".into(), write_back: None };
        let append = WriteFlags { append: true };
        // No flags: byte for byte the frame every worker reads.
        assert_eq!(plain.encode_with(WriteFlags::default()), plain.encode());
        for begin in [
            plain.clone(),
            WriteBegin {
                write_back: Some(WriteBackCopy { write_id: "ab-1".into(), rank: 2 }),
                ..plain.clone()
            },
        ] {
            for flags in [WriteFlags::default(), append] {
                let enc = begin.encode_with(flags);
                let (op, len) = decode_request_header(enc[..REQUEST_HEADER_LEN].try_into().unwrap()).unwrap();
                assert_eq!((op, len), (Op::WriteBegin, enc.len() - REQUEST_HEADER_LEN));
                assert_eq!(WriteBegin::decode(&enc[REQUEST_HEADER_LEN..]).unwrap(), (begin.clone(), flags));
            }
            // An append is never read as a replacement by a decoder that ignores flags.
            let enc = begin.encode_with(append);
            assert_eq!(WriteBegin::decode_body(&enc[REQUEST_HEADER_LEN..]), Err(FrameError::Malformed));
        }
        let mut body = plain.encode_with(append)[REQUEST_HEADER_LEN..].to_vec();
        *body.last_mut().unwrap() = 0b10;
        assert_eq!(WriteBegin::decode(&body), Err(FrameError::Malformed), "an unknown flag");
        body.pop();
        assert_eq!(WriteBegin::decode(&body), Err(FrameError::Malformed), "no write-back id and no flags");
    }

    #[test]
    fn copy_frames_round_trip_and_are_bounded() {
        let req = CopyRequest {
            req_id: 7,
            src: "/data/a/ü.bin".into(),
            dst: "/other/b.bin".into(),
            version: String::new(),
            size: 0,
        };
        let wb = CopyRequest { version: "wb-0af3".into(), size: 12, ..req.clone() };
        for r in [req.clone(), wb] {
            let enc = r.encode();
            let (op, len) = decode_request_header(enc[..REQUEST_HEADER_LEN].try_into().unwrap()).unwrap();
            assert_eq!((op, len), (Op::Copy, enc.len() - REQUEST_HEADER_LEN));
            assert_eq!(CopyRequest::decode_body(&enc[REQUEST_HEADER_LEN..]).unwrap(), r);
            let body = &enc[REQUEST_HEADER_LEN..];
            for cut in 0..body.len() {
                assert!(CopyRequest::decode_body(&body[..cut]).is_err(), "cut at {cut}");
            }
            let mut longer = body.to_vec();
            longer.push(0);
            assert_eq!(CopyRequest::decode_body(&longer), Err(FrameError::Malformed));
        }
        // A size without a version means nothing: refused rather than guessed at.
        let sized = CopyRequest { size: 5, ..req };
        assert_eq!(
            CopyRequest::decode_body(&sized.encode()[REQUEST_HEADER_LEN..]),
            Err(FrameError::Malformed)
        );
        assert!(decode_request_header(&request_header(Op::Copy, MAX_COPY_BODY)).is_ok());
        assert!(matches!(
            decode_request_header(&request_header(Op::Copy, MAX_COPY_BODY + 1)),
            Err(FrameError::BodyTooLarge(_))
        ));

        for answer in [
            CopyAnswer { via: CopyVia::Ufs, bytes: 1 << 40 },
            CopyAnswer { via: CopyVia::Streamed, bytes: 0 },
        ] {
            assert_eq!(CopyAnswer::decode(&answer.encode()), Ok(answer));
        }
        assert!(CopyAnswer::decode(&[3, 0, 0, 0, 0, 0, 0, 0, 0]).is_err());
        assert!(CopyAnswer::decode(&[1; 8]).is_err());
    }

    fn item(req_id: u64, path: &str) -> ReadBlockRequest {
        ReadBlockRequest { req_id, path: path.into(), ..sample() }
    }

    #[test]
    fn read_many_round_trips_in_order() {
        let batch = ReadMany { items: vec![item(3, "/d/a"), sample(), item(1, "/d/ü/c")] };
        let frame = batch.encode();
        let header: [u8; REQUEST_HEADER_LEN] = frame[..REQUEST_HEADER_LEN].try_into().unwrap();
        assert_eq!(decode_request_header(&header).unwrap(), (Op::ReadMany, frame.len() - REQUEST_HEADER_LEN));
        assert_eq!(ReadMany::decode_body(&frame[REQUEST_HEADER_LEN..]).unwrap(), batch);
        // A trailing byte, a missing one, or a count that does not match the items is malformed.
        let body = &frame[REQUEST_HEADER_LEN..];
        let mut longer = body.to_vec();
        longer.push(0);
        assert_eq!(ReadMany::decode_body(&longer), Err(FrameError::Malformed));
        assert_eq!(ReadMany::decode_body(&body[..body.len() - 1]), Err(FrameError::Malformed));
        let mut fewer = body.to_vec();
        fewer[..4].copy_from_slice(&2u32.to_le_bytes());
        assert_eq!(ReadMany::decode_body(&fewer), Err(FrameError::Malformed));
    }

    #[test]
    fn read_many_over_its_limits_is_refused() {
        let full = ReadMany { items: (0..MAX_READ_MANY_ITEMS as u64).map(|i| item(i + 1, "/d/f")).collect() };
        assert_eq!(ReadMany::decode_body(&full.encode()[REQUEST_HEADER_LEN..]).unwrap().items.len(), 256);
        let over =
            ReadMany { items: (0..=MAX_READ_MANY_ITEMS as u64).map(|i| item(i + 1, "/d/f")).collect() };
        assert_eq!(ReadMany::decode_body(&over.encode()[REQUEST_HEADER_LEN..]), Err(FrameError::Malformed));
        assert_eq!(ReadMany::decode_body(&0u32.to_le_bytes()), Err(FrameError::Malformed), "no items");
        // The header is refused before any body is read.
        assert!(matches!(
            decode_request_header(&request_header(Op::ReadMany, MAX_READ_MANY_BODY + 1)),
            Err(FrameError::BodyTooLarge(_))
        ));
        assert!(ReadMany::decode_body(&vec![0; MAX_READ_MANY_BODY + 1]).is_err());
        // `fits` keeps a client's batches inside both limits.
        let long = item(1, &format!("/{}", "p".repeat(crate::path::MAX_PATH_LEN - 1)));
        let (mut count, mut body) = (0, 0);
        while ReadMany::fits(count, body, &long) {
            count += 1;
            body += long.body_len();
        }
        assert!(count > 0 && count < MAX_READ_MANY_ITEMS, "{count}");
        let batch = ReadMany { items: vec![long; count] };
        let frame = batch.encode();
        assert!(frame.len() - REQUEST_HEADER_LEN <= MAX_READ_MANY_BODY);
        assert_eq!(ReadMany::decode_body(&frame[REQUEST_HEADER_LEN..]).unwrap().items.len(), count);
        assert!(!ReadMany::fits(MAX_READ_MANY_ITEMS, 0, &sample()));
    }

    #[test]
    fn prefetch_hints_round_trip_and_are_bounded() {
        let hints = PrefetchHints { req_id: 9, stream: 77, items: vec![item(0, "/d/a"), item(0, "/d/ü/b")] };
        let frame = hints.encode();
        let header: [u8; REQUEST_HEADER_LEN] = frame[..REQUEST_HEADER_LEN].try_into().unwrap();
        assert_eq!(decode_request_header(&header).unwrap(), (Op::Prefetch, frame.len() - REQUEST_HEADER_LEN));
        assert_eq!(PrefetchHints::decode_body(&frame[REQUEST_HEADER_LEN..]).unwrap(), hints);
        // No items: a stream cleared.
        let clear = PrefetchHints { req_id: 1, stream: 77, items: Vec::new() };
        assert_eq!(PrefetchHints::decode_body(&clear.encode()[REQUEST_HEADER_LEN..]).unwrap(), clear);
        let body = &frame[REQUEST_HEADER_LEN..];
        assert_eq!(PrefetchHints::decode_body(&body[..body.len() - 1]), Err(FrameError::Malformed));
        let mut more = body.to_vec();
        more[16..20].copy_from_slice(&(MAX_PREFETCH_ITEMS as u32 + 1).to_le_bytes());
        assert_eq!(PrefetchHints::decode_body(&more), Err(FrameError::Malformed));
        assert!(matches!(
            decode_request_header(&request_header(Op::Prefetch, MAX_PREFETCH_BODY + 1)),
            Err(FrameError::BodyTooLarge(_))
        ));
        assert!(!PrefetchHints::fits(MAX_PREFETCH_ITEMS, 0, &sample()));
    }

    proptest! {
        #[test]
        fn arbitrary_bodies_never_panic(body in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = ReadBlockRequest::decode_body(&body);
        }

        #[test]
        fn arbitrary_copy_and_write_begin_bodies_never_panic(
            body in proptest::collection::vec(any::<u8>(), 0..300),
        ) {
            let _ = CopyRequest::decode_body(&body);
            let _ = CopyAnswer::decode(&body);
            let _ = WriteBegin::decode(&body);
        }

        #[test]
        fn copy_requests_round_trip(
            src in "/[a-z0-9/._-]{1,40}",
            dst in "/[a-z0-9/._-]{1,40}",
            version in "[a-zA-Z0-9-]{0,30}",
            size in any::<u64>(),
            req_id in any::<u64>(),
        ) {
            let size = if version.is_empty() { 0 } else { size };
            let req = CopyRequest { req_id, src, dst, version, size };
            prop_assert_eq!(CopyRequest::decode_body(&req.encode()[REQUEST_HEADER_LEN..]).unwrap(), req);
        }

        #[test]
        fn arbitrary_read_many_bodies_never_panic(body in proptest::collection::vec(any::<u8>(), 0..600)) {
            let _ = ReadMany::decode_body(&body);
            let _ = PrefetchHints::decode_body(&body);
            // The same bytes after a valid count, so decoding reaches the items.
            let mut counted = 3u32.to_le_bytes().to_vec();
            counted.extend_from_slice(&body);
            let _ = ReadMany::decode_body(&counted);
        }

        #[test]
        fn truncated_bodies_are_errors(cut in 0usize..60) {
            let enc = sample().encode();
            let body = &enc[REQUEST_HEADER_LEN..];
            let cut = cut.min(body.len() - 1);
            prop_assert!(ReadBlockRequest::decode_body(&body[..cut]).is_err());
        }
    }
}
