//! Byte sizes as people write them: `8GiB`, `512MiB`, `1.5G`, `4096`.

use std::fmt;

/// A size string that could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid size {input:?}: {reason} (write e.g. 8GiB, 512MiB, 1.5GB or a plain byte count)")]
pub struct ParseSizeError {
    input: String,
    reason: &'static str,
}

/// Parses a byte size. Binary (`KiB`, `MiB`, `GiB`, `TiB`, and `K`, `M`, `G`, `T`) and
/// decimal (`KB`, `MB`, `GB`, `TB`) units; case-insensitive; fractions allowed with units.
pub fn parse_size(input: &str) -> Result<u64, ParseSizeError> {
    let err = |reason| ParseSizeError { input: input.to_string(), reason };
    let s = input.trim();
    if s.is_empty() {
        return Err(err("empty"));
    }
    let split = s.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let unit = unit.trim().to_ascii_lowercase();
    let mult: u64 = match unit.as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "t" | "tib" => 1 << 40,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        _ => return Err(err("unknown unit")),
    };
    if num.is_empty() {
        return Err(err("no number"));
    }
    if num.bytes().all(|c| c.is_ascii_digit()) {
        // Digits only: exact, or too large (not a float's rounding of it).
        return num.parse::<u64>().ok().and_then(|n| n.checked_mul(mult)).ok_or_else(|| err("too large"));
    }
    if mult == 1 {
        return Err(err("a byte count is a whole number"));
    }
    let f: f64 = num.parse().map_err(|_| err("not a number"))?;
    let v = (f * mult as f64).round();
    // Below 2^64 (`u64::MAX as f64` rounds up to 2^64, so it cannot be the limit).
    if !(0.0..18_446_744_073_709_551_616.0).contains(&v) {
        return Err(err("too large"));
    }
    Ok(v as u64)
}

/// Formats bytes with a binary unit and up to two decimals: `1.50 GiB`, `512 MiB`, `0 B`.
pub fn format_size(bytes: u64) -> String {
    SizeDisplay(bytes).to_string()
}

/// Display adapter for byte counts.
#[derive(Debug, Clone, Copy)]
pub struct SizeDisplay(pub u64);

impl fmt::Display for SizeDisplay {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
        let mut v = self.0 as f64;
        let mut i = 0;
        while v >= 1024.0 && i + 1 < UNITS.len() {
            v /= 1024.0;
            i += 1;
        }
        if i == 0 {
            write!(f, "{} B", self.0)
        } else if (v - v.round()).abs() < 0.005 {
            write!(f, "{:.0} {}", v, UNITS[i])
        } else {
            write!(f, "{:.2} {}", v, UNITS[i])
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_units() {
        assert_eq!(parse_size("8GiB").unwrap(), 8 << 30);
        assert_eq!(parse_size("512 MiB").unwrap(), 512 << 20);
        assert_eq!(parse_size("1.5g").unwrap(), 3 << 29);
        assert_eq!(parse_size("2GB").unwrap(), 2_000_000_000);
        assert_eq!(parse_size("4096").unwrap(), 4096);
    }

    #[test]
    fn rejects_nonsense() {
        assert!(parse_size("").is_err());
        assert!(parse_size("GiB").is_err());
        assert!(parse_size("12 parsecs").is_err());
        assert!(parse_size("99999999999TiB").is_err());
        assert!(parse_size("-1").is_err());
        // A byte count is whole: no silent rounding of 1.5 bytes to 2 or 0.4 to 0.
        for fraction in ["1.5", "0.4", "2.5B"] {
            let e = parse_size(fraction).unwrap_err().to_string();
            assert!(e.contains("whole number"), "{fraction}: {e}");
        }
        // Just past 2^64 is too large, not 2^64 - 1.
        for big in ["18446744073709551616", "18446744073709551617", "16EiB", "16777216TiB"] {
            assert!(parse_size(big).is_err(), "{big}");
        }
        assert_eq!(parse_size("18446744073709551615").unwrap(), u64::MAX);
        assert_eq!(parse_size("0.5KiB").unwrap(), 512);
    }

    #[test]
    fn formats() {
        assert_eq!(format_size(0), "0 B");
        assert_eq!(format_size(2 << 20), "2 MiB");
        assert_eq!(format_size(3 << 29), "1.50 GiB");
    }
}
