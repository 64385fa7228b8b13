//! A mount's options, typed: parsed once from the `-o key=value` pairs the master stores, then
//! used by the master (metadata TTL, writes allowed), the worker (block size, mode) and the CLI.
//! Keys Strata does not interpret are the UFS service's own (endpoint, region, credentials...)
//! and stay in [`MountOptions::ufs`].

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use thiserror::Error;

use crate::units::{parse_duration, parse_size};
use crate::{DEFAULT_BLOCK_SIZE, DEFAULT_METADATA_TTL_MS, MAX_BLOCK_SIZE};

/// Mount options that Strata itself interprets (the `ufs_*` ones by the UFS layer); everything
/// else is handed to the UFS service.
pub const STRATA_MOUNT_OPTIONS: &[&str] = &[
    "block_size",
    "metadata_ttl",
    "mode",
    "write_replicas",
    "read_replicas",
    "pack_threshold",
    "cache_ttl",
    "quota",
    "upload_parallelism",
    "upload_bandwidth",
    "on_full",
    "ufs_retries",
    "ufs_timeout",
    "ufs_io_timeout",
    "ufs_read_parallelism",
];

/// Default `write_replicas`: a write-back file survives the loss of one worker.
pub const DEFAULT_WRITE_REPLICAS: u32 = 2;
/// Largest `write_replicas` (a client streams every byte to each).
pub const MAX_WRITE_REPLICAS: u32 = 8;
/// Largest `read_replicas`: a miss on a replica asks at most that many peers before the UFS.
pub const MAX_READ_REPLICAS: u32 = 8;
/// Default `upload_parallelism`: uploads one worker runs at once for a mount.
pub const DEFAULT_UPLOAD_PARALLELISM: u32 = 4;

/// Smallest block size a mount may choose.
pub const MIN_BLOCK_SIZE: u64 = 4096;
/// Default `pack_threshold`: files smaller than this are small files (packed on NVMe, loaded in
/// batches by warmup).
pub const DEFAULT_PACK_THRESHOLD: u64 = 1 << 20;

/// Whether writes through Strata may reach a mount's UFS.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum MountMode {
    /// Reads only (the default): writes, `rm` and `mkdir` are refused.
    #[default]
    ReadOnly,
    /// A write streams through a worker to the UFS and is acknowledged once the UFS has it.
    WriteThrough,
    /// A write is acknowledged once `write_replicas` workers hold it durably (fsync) in their
    /// journals; a worker uploads it to the UFS in the background (docs/WRITEBACK.md).
    WriteBack,
}

/// What a write-back worker does when its journal's disk is full (`on_full`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum OnFull {
    /// Refuse the write with a clear error; the old file stays (the default).
    #[default]
    Refuse,
    /// Write the file through to the UFS instead, acknowledged once the UFS has it.
    WriteThrough,
}

impl MountMode {
    pub fn as_str(self) -> &'static str {
        match self {
            MountMode::ReadOnly => "read-only",
            MountMode::WriteThrough => "write-through",
            MountMode::WriteBack => "write-back",
        }
    }

    /// Clients may write, delete and make directories through Strata.
    pub fn is_writable(self) -> bool {
        !matches!(self, MountMode::ReadOnly)
    }
}

impl fmt::Display for MountMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for MountMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "read-only" => Ok(MountMode::ReadOnly),
            "write-through" => Ok(MountMode::WriteThrough),
            "write-back" => Ok(MountMode::WriteBack),
            _ => Err("expected read-only, write-through or write-back".into()),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("mount option {key}={value:?}: {reason}")]
pub struct MountOptionError {
    pub key: String,
    pub value: String,
    pub reason: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountOptions {
    pub mode: MountMode,
    /// Bytes per block (`block_size`, 4 KiB to 256 MiB, default 4 MiB).
    pub block_size: u64,
    /// How long a stat or listing of the UFS is trusted (`metadata_ttl`, default 10 s).
    pub metadata_ttl: Duration,
    /// Write-back: distinct workers whose journals must hold a file before it is acknowledged
    /// (`write_replicas`, 1 to 8, default 2).
    pub write_replicas: u32,
    /// How many of a block's first ring owners clients may read it from (`read_replicas`, 1
    /// to 8, default 1): with more than one, each read asks first the one of them the client
    /// has fewer reads in flight to (power of two choices), or one on the client's own node.
    pub read_replicas: u32,
    /// Files smaller than this (and no larger than a block) are small files (`pack_threshold`,
    /// e.g. `256KiB`; default 1 MiB; 0 turns it off): workers keep them packed many to a
    /// container file on NVMe, and warmup loads them in batches, one task for many files.
    pub pack_threshold: u64,
    /// How long a block of this mount stays cached after it was stored on a worker
    /// (`cache_ttl`, e.g. `7d`; default none: until evicted). Pinned blocks stay while pinned.
    pub cache_ttl: Option<Duration>,
    /// Bytes of this mount's blocks the cluster's tiers may hold together (`quota`, e.g.
    /// `2TiB`; default none). Each worker keeps the mount within its ring share of it.
    pub quota: Option<u64>,
    /// Write-back: uploads one worker runs at once for this mount (`upload_parallelism`,
    /// default 4).
    pub upload_parallelism: u32,
    /// Write-back: bytes per second one worker uploads for this mount (`upload_bandwidth`,
    /// e.g. `200MiB`; default 0, no cap).
    pub upload_bandwidth: u64,
    /// Write-back: what a worker whose journal disk is full does (`on_full`).
    pub on_full: OnFull,
    /// Every option not listed above: the UFS service's (and the UFS layer's `ufs_*`).
    pub ufs: BTreeMap<String, String>,
}

impl Default for MountOptions {
    fn default() -> Self {
        Self {
            mode: MountMode::default(),
            block_size: DEFAULT_BLOCK_SIZE,
            metadata_ttl: Duration::from_millis(DEFAULT_METADATA_TTL_MS),
            write_replicas: DEFAULT_WRITE_REPLICAS,
            read_replicas: 1,
            pack_threshold: DEFAULT_PACK_THRESHOLD,
            cache_ttl: None,
            quota: None,
            upload_parallelism: DEFAULT_UPLOAD_PARALLELISM,
            upload_bandwidth: 0,
            on_full: OnFull::default(),
            ufs: BTreeMap::new(),
        }
    }
}

impl MountOptions {
    /// Parses and checks the options of a mount.
    pub fn parse<'a>(
        options: impl IntoIterator<Item = (&'a String, &'a String)>,
    ) -> Result<Self, MountOptionError> {
        let mut out = Self::default();
        for (key, value) in options {
            let bad = |reason: &str| MountOptionError {
                key: key.clone(),
                value: value.clone(),
                reason: reason.to_string(),
            };
            match key.as_str() {
                "block_size" => {
                    out.block_size = parse_size(value)
                        .filter(|b| (MIN_BLOCK_SIZE..=MAX_BLOCK_SIZE).contains(b))
                        .ok_or_else(|| {
                            bad(&format!(
                                "expected a size between 4KiB and {}MiB, e.g. 4MiB",
                                MAX_BLOCK_SIZE >> 20
                            ))
                        })?;
                }
                "metadata_ttl" => {
                    out.metadata_ttl = parse_duration(value)
                        .ok_or_else(|| bad("expected a duration such as 500ms, 10s, 5m or 0"))?;
                }
                "mode" => out.mode = value.parse().map_err(|reason: String| bad(&reason))?,
                "write_replicas" => {
                    out.write_replicas =
                        value.parse().ok().filter(|n| (1..=MAX_WRITE_REPLICAS).contains(n)).ok_or_else(
                            || bad(&format!("expected a number of workers from 1 to {MAX_WRITE_REPLICAS}")),
                        )?;
                }
                "read_replicas" => {
                    out.read_replicas =
                        value.parse().ok().filter(|n| (1..=MAX_READ_REPLICAS).contains(n)).ok_or_else(
                            || bad(&format!("expected a number of workers from 1 to {MAX_READ_REPLICAS}")),
                        )?;
                }
                "pack_threshold" => {
                    out.pack_threshold =
                        parse_size(value).filter(|t| *t <= MAX_BLOCK_SIZE).ok_or_else(|| {
                            bad(&format!(
                                "expected a size up to {}MiB such as 256KiB or 1MiB, or 0 to pack nothing",
                                MAX_BLOCK_SIZE >> 20
                            ))
                        })?;
                }
                "cache_ttl" => {
                    out.cache_ttl = Some(
                        parse_duration(value)
                            .filter(|d| !d.is_zero())
                            .ok_or_else(|| bad("expected a duration such as 30m, 12h or 7d"))?,
                    );
                }
                "quota" => {
                    out.quota = Some(
                        parse_size(value)
                            .filter(|q| *q > 0)
                            .ok_or_else(|| bad("expected a size such as 500GiB or 2TiB"))?,
                    );
                }
                "upload_parallelism" => {
                    out.upload_parallelism = value
                        .parse()
                        .ok()
                        .filter(|n| (1..=256).contains(n))
                        .ok_or_else(|| bad("expected a number of uploads from 1 to 256"))?;
                }
                "upload_bandwidth" => {
                    out.upload_bandwidth = parse_size(value)
                        .ok_or_else(|| bad("expected bytes per second such as 200MiB, or 0 for no cap"))?;
                }
                "on_full" => {
                    out.on_full = match value.as_str() {
                        "refuse" => OnFull::Refuse,
                        "write-through" => OnFull::WriteThrough,
                        _ => return Err(bad("expected refuse or write-through")),
                    };
                }
                _ => {
                    out.ufs.insert(key.clone(), value.clone());
                }
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(pairs: &[(&str, &str)]) -> Result<MountOptions, MountOptionError> {
        let map: BTreeMap<String, String> =
            pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        MountOptions::parse(&map)
    }

    #[test]
    fn defaults_and_typed_values() {
        assert_eq!(parse(&[]).unwrap(), MountOptions::default());
        let o = parse(&[
            ("block_size", "1MiB"),
            ("metadata_ttl", "30s"),
            ("mode", "write-through"),
            ("region", "x"),
        ])
        .unwrap();
        assert_eq!(o.block_size, 1 << 20);
        assert_eq!(o.metadata_ttl, Duration::from_secs(30));
        assert_eq!(o.mode, MountMode::WriteThrough);
        assert!(o.mode.is_writable());
        assert_eq!(o.ufs.get("region").map(String::as_str), Some("x"));
        assert_eq!(o.read_replicas, 1, "reads use the first owner unless asked");
        assert_eq!(parse(&[("read_replicas", "3")]).unwrap().read_replicas, 3);
        assert_eq!(o.pack_threshold, 1 << 20, "small files are those under 1 MiB unless asked");
        assert_eq!(parse(&[("pack_threshold", "256KiB")]).unwrap().pack_threshold, 256 << 10);
        assert_eq!(parse(&[("pack_threshold", "0")]).unwrap().pack_threshold, 0);
        assert_eq!((o.cache_ttl, o.quota), (None, None), "no expiry and no quota unless asked");
        let o = parse(&[("cache_ttl", "7d"), ("quota", "2TiB")]).unwrap();
        assert_eq!(o.cache_ttl, Some(Duration::from_secs(7 * 86_400)));
        assert_eq!(o.quota, Some(2 << 40));
        assert!(!o.ufs.contains_key("mode"), "Strata's own options are not the UFS's");
    }

    #[test]
    fn bad_values_name_the_option() {
        let e = parse(&[("block_size", "1KiB")]).unwrap_err();
        assert_eq!(e.key, "block_size");
        assert!(parse(&[("block_size", "512MiB")]).is_err());
        assert!(parse(&[("metadata_ttl", "10")]).is_err());
        let e = parse(&[("mode", "write-back-ish")]).unwrap_err();
        assert!(e.to_string().contains("read-only, write-through or write-back"), "{e}");
        for (k, v) in [
            ("write_replicas", "0"),
            ("write_replicas", "9"),
            ("read_replicas", "0"),
            ("read_replicas", "9"),
            ("read_replicas", "two"),
            ("cache_ttl", "0"),
            ("cache_ttl", "soon"),
            ("quota", "0"),
            ("quota", "lots"),
            ("upload_parallelism", "x"),
            ("pack_threshold", "1GiB"),
            ("pack_threshold", "small"),
        ] {
            assert_eq!(parse(&[(k, v)]).unwrap_err().key, k);
        }
        assert_eq!(parse(&[("on_full", "spill")]).unwrap_err().key, "on_full");
    }

    #[test]
    fn write_back_options() {
        let o = parse(&[
            ("mode", "write-back"),
            ("write_replicas", "3"),
            ("upload_bandwidth", "64MiB"),
            ("on_full", "write-through"),
        ])
        .unwrap();
        assert_eq!(o.mode, MountMode::WriteBack);
        assert!(o.mode.is_writable());
        assert_eq!((o.write_replicas, o.upload_parallelism), (3, DEFAULT_UPLOAD_PARALLELISM));
        assert_eq!((o.upload_bandwidth, o.on_full), (64 << 20, OnFull::WriteThrough));
        assert!(o.ufs.is_empty());
        assert_eq!(parse(&[]).unwrap().write_replicas, 2);
    }
}
