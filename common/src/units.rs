//! Sizes and durations as people write them in flags, TOML and mount options (`4MiB`, `30s`),
//! parsed in one place for every process.

use std::time::Duration;

/// `4194304`, `4MiB`, `4M`, `512KiB`, `1GiB`, `2TiB` → bytes (binary units; `k`/`m`/`g`/`t` and
/// `kb`/`mb`/... mean the same). `None` for anything else or an overflow.
pub fn parse_size(s: &str) -> Option<u64> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: u64 = num.parse().ok()?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        _ => return None,
    };
    n.checked_mul(mult)
}

/// `500ms`, `10s`, `5m`, `2h`, `7d`, or `0` → a duration. A bare number other than 0 is refused
/// (seconds or milliseconds? the reader cannot tell).
pub fn parse_duration(s: &str) -> Option<Duration> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: u64 = num.parse().ok()?;
    Some(match unit {
        "" if n == 0 => Duration::ZERO,
        "ms" => Duration::from_millis(n),
        "s" => Duration::from_secs(n),
        "m" => Duration::from_secs(n.checked_mul(60)?),
        "h" => Duration::from_secs(n.checked_mul(3600)?),
        "d" => Duration::from_secs(n.checked_mul(86_400)?),
        _ => return None,
    })
}

/// A duration the way [`parse_duration`] reads it, in the largest unit that divides it
/// (`7d`, `90m`, `1500ms`), so that what is shown can be typed back.
pub fn format_duration(d: Duration) -> String {
    let ms = d.as_millis();
    if ms == 0 {
        return "0".into();
    }
    for (unit, per) in [("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1000)] {
        if ms.is_multiple_of(per) {
            return format!("{}{unit}", ms / per);
        }
    }
    format!("{ms}ms")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4194304"), Some(4 << 20));
        assert_eq!(parse_size("4MiB"), Some(4 << 20));
        assert_eq!(parse_size(" 512 KiB "), Some(512 << 10));
        assert_eq!(parse_size("2G"), Some(2 << 30));
        assert_eq!(parse_size("2TiB"), Some(2 << 40));
        assert_eq!(parse_size("1.5GiB"), None);
        assert_eq!(parse_size("MiB"), None);
        assert_eq!(parse_size("99999999999999999999"), None);
        assert_eq!(parse_size("20000000TiB"), None, "overflow");
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("0"), Some(Duration::ZERO));
        assert_eq!(parse_duration("5"), None);
        assert_eq!(parse_duration("500ms"), Some(Duration::from_millis(500)));
        assert_eq!(parse_duration("2m"), Some(Duration::from_secs(120)));
        assert_eq!(parse_duration("7d"), Some(Duration::from_secs(7 * 86_400)));
        assert_eq!(parse_duration("1 s"), None);
        for shown in ["0", "7d", "90m", "1500ms", "36h", "45s"] {
            assert_eq!(format_duration(parse_duration(shown).unwrap()), shown);
        }
    }
}
