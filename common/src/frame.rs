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
//! `status` 0 is success and the payload is data; otherwise it is an [`ErrorKind`] code and
//! the payload a UTF-8 message.
//!
//! A write replaces one whole file, streamed on one connection (see [`WriteBegin`]):
//! ```text
//! WriteBegin  body = req_id:u64 path_len:u16 path   → response (no payload): go ahead, or error
//! WriteData   body = bytes (≤ MAX_WRITE_CHUNK)        (no response)
//! WriteEnd    body = empty                           → response (no payload): committed, or error
//! ```
//! A failure in the middle is answered at `WriteEnd` (the data frames already sent are read and
//! dropped, so the connection stays in sync); closing the connection before `WriteEnd` aborts
//! the write and leaves the old object in place.

use thiserror::Error;

use crate::error::ErrorKind;

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
    #[error("unknown status code {0}")]
    UnknownStatus(u8),
}

impl ReadBlockRequest {
    pub fn encode(&self) -> Vec<u8> {
        let body_len = 48 + 2 + self.path.len() + 2 + self.version.len();
        let mut out = Vec::with_capacity(REQUEST_HEADER_LEN + body_len);
        out.extend_from_slice(&REQUEST_MAGIC);
        out.extend_from_slice(&[Op::ReadBlock as u8, 0, 0, 0]);
        out.extend_from_slice(&(body_len as u32).to_le_bytes());
        for v in [self.req_id, self.file_size, self.block_size, self.block_index, self.offset, self.len] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out.extend_from_slice(&(self.path.len() as u16).to_le_bytes());
        out.extend_from_slice(self.path.as_bytes());
        out.extend_from_slice(&(self.version.len() as u16).to_le_bytes());
        out.extend_from_slice(self.version.as_bytes());
        out
    }

    pub fn decode_body(body: &[u8]) -> Result<Self, FrameError> {
        let mut r = Reader { buf: body, pos: 0 };
        let req_id = r.u64()?;
        let file_size = r.u64()?;
        let block_size = r.u64()?;
        let block_index = r.u64()?;
        let offset = r.u64()?;
        let len = r.u64()?;
        let path = r.string()?;
        let version = r.string()?;
        if r.pos != body.len() {
            return Err(FrameError::Malformed);
        }
        Ok(Self { req_id, path, version, file_size, block_size, block_index, offset, len })
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
        other => return Err(FrameError::UnknownOp(other)),
    };
    let body_len = u32::from_le_bytes(h[8..12].try_into().expect("4 bytes")) as usize;
    let limit = match op {
        Op::WriteData => MAX_WRITE_CHUNK,
        Op::WriteEnd => 0,
        _ => MAX_REQUEST_BODY,
    };
    if body_len > limit {
        return Err(FrameError::BodyTooLarge(body_len));
    }
    Ok((op, body_len))
}

/// The first frame of a write: which file to replace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WriteBegin {
    pub req_id: u64,
    /// Strata path of the file (normalised, absolute).
    pub path: String,
}

impl WriteBegin {
    pub fn encode(&self) -> Vec<u8> {
        let body_len = 8 + 2 + self.path.len();
        let mut out = request_header(Op::WriteBegin, body_len).to_vec();
        out.extend_from_slice(&self.req_id.to_le_bytes());
        out.extend_from_slice(&(self.path.len() as u16).to_le_bytes());
        out.extend_from_slice(self.path.as_bytes());
        out
    }

    pub fn decode_body(body: &[u8]) -> Result<Self, FrameError> {
        let mut r = Reader { buf: body, pos: 0 };
        let req_id = r.u64()?;
        let path = r.string()?;
        if r.pos != body.len() {
            return Err(FrameError::Malformed);
        }
        Ok(Self { req_id, path })
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
            code => Err(ErrorKind::from_u8(code).ok_or(FrameError::UnknownStatus(code))?),
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
    fn string(&mut self) -> Result<String, FrameError> {
        let len = u16::from_le_bytes(self.take(2)?.try_into().expect("2 bytes")) as usize;
        let bytes = self.take(len)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| FrameError::NotUtf8)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

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
    }

    #[test]
    fn write_frames_round_trip() {
        let begin = WriteBegin { req_id: 3, path: "/data/ü.bin".into() };
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
        assert!(matches!(
            decode_request_header(&request_header(Op::WriteEnd, 1)),
            Err(FrameError::BodyTooLarge(1))
        ));
    }

    proptest! {
        #[test]
        fn arbitrary_bodies_never_panic(body in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = ReadBlockRequest::decode_body(&body);
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
