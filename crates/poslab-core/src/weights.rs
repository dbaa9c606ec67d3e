//! A safetensors file read header first: the names, dtypes and shapes of its tensors are known
//! before any of their data is read, so a file is checked against the model that will read it
//! before memory is spent on it, and only the tensors asked for are read. A sparse 30 GiB file,
//! a header that promises more than the file holds, or a tensor of a dtype poslab does not load
//! (`F8_E4M3`, on which candle's conversion never ends) is refused by name; no read needs more
//! memory than the tensors it returns.

use std::collections::{BTreeMap, HashMap};
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use candle::{DType, Device, Tensor};

use crate::error::{Error, Result};

/// The dtypes poslab reads weights in (safetensors' names); every other is refused.
pub const ACCEPTED: [&str; 4] = ["F32", "F16", "BF16", "F64"];

/// The largest header safetensors itself accepts: 100 MB.
const MAX_HEADER: u64 = 100_000_000;

/// One tensor's entry in the header.
#[derive(Clone, Debug, PartialEq)]
pub struct Entry {
    /// As safetensors names it: `F32`, `BF16`, `F8_E4M3`, ...
    pub dtype: String,
    /// The tensor's shape.
    pub shape: Vec<usize>,
    /// Byte range in the data section.
    begin: u64,
    end: u64,
}

impl Entry {
    /// The number of elements (as u128: a header may claim any shape).
    pub fn elements(&self) -> u128 {
        self.shape.iter().map(|&d| d as u128).product()
    }
}

/// An open safetensors file: its header read and checked, its data not.
#[derive(Debug)]
pub struct WeightsFile {
    path: PathBuf,
    file: std::fs::File,
    /// Where the data section starts in the file.
    data_start: u64,
    entries: BTreeMap<String, Entry>,
    metadata: HashMap<String, String>,
}

/// The candle dtype of one of [`ACCEPTED`].
fn dtype_of(name: &str) -> Option<DType> {
    match name {
        "F32" => Some(DType::F32),
        "F16" => Some(DType::F16),
        "BF16" => Some(DType::BF16),
        "F64" => Some(DType::F64),
        _ => None,
    }
}

/// Bytes per element of a safetensors dtype, for the size check of tensors poslab may skip.
fn dtype_bytes(name: &str) -> Option<u128> {
    Some(match name {
        "BOOL" | "U8" | "I8" | "F8_E5M2" | "F8_E4M3" | "F8_E8M0" => 1,
        "I16" | "U16" | "F16" | "BF16" => 2,
        "I32" | "U32" | "F32" => 4,
        "I64" | "U64" | "F64" | "C64" => 8,
        _ => return None,
    })
}

impl WeightsFile {
    /// Opens `path` (a regular file of at most [`crate::io::MAX_WEIGHTS_BYTES`]) and reads and
    /// checks its header: every entry's dtype, shape and byte range, inside the file.
    pub fn open(path: &Path) -> Result<Self> {
        let meta = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
        if !meta.is_file() {
            return Err(Error::Input(format!(
                "{}: not a regular file (a folder, device or pipe, or a link to one); give the \
                 path of a safetensors weights file",
                path.display()
            )));
        }
        let len = meta.len();
        if len > crate::io::MAX_WEIGHTS_BYTES {
            return Err(Error::Input(format!(
                "{}: {} is too large for a weights file (the limit is {}): is this the right \
                 file?",
                path.display(),
                crate::io::human_bytes(len),
                crate::io::human_bytes(crate::io::MAX_WEIGHTS_BYTES)
            )));
        }
        let corrupt = |why: String| Error::Checkpoint {
            path: path.into(),
            message: format!(
                "not a readable safetensors file ({why}); it may be truncated or corrupt: save \
                 it again or point to the right file"
            ),
        };
        let mut file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
        let mut n = [0u8; 8];
        file.read_exact(&mut n)
            .map_err(|_| corrupt(format!("{len} bytes, shorter than a header")))?;
        let n = u64::from_le_bytes(n);
        if n > MAX_HEADER || n > len - 8 {
            return Err(corrupt(format!(
                "a header of {n} bytes in a file of {len} bytes"
            )));
        }
        let mut header = vec![0u8; n as usize];
        file.read_exact(&mut header)
            .map_err(|e| corrupt(format!("reading the header: {e}")))?;
        let header: serde_json::Map<String, serde_json::Value> =
            serde_json::from_slice(&header).map_err(|e| corrupt(format!("its header: {e}")))?;
        let data_start = 8 + n;
        let data_len = len - data_start;
        let mut entries = BTreeMap::new();
        let mut metadata = HashMap::new();
        for (name, value) in header {
            if name == "__metadata__" {
                metadata = serde_json::from_value(value)
                    .map_err(|e| corrupt(format!("its metadata: {e}")))?;
                continue;
            }
            let bad = |why: &str| corrupt(format!("tensor `{name}`: {why}"));
            let dtype = value["dtype"]
                .as_str()
                .ok_or_else(|| bad("no dtype"))?
                .to_string();
            let shape: Vec<usize> = serde_json::from_value(value["shape"].clone())
                .map_err(|_| bad("no shape of whole numbers"))?;
            let [begin, end]: [u64; 2] = serde_json::from_value(value["data_offsets"].clone())
                .map_err(|_| bad("no data_offsets [begin, end]"))?;
            if begin > end || end > data_len {
                return Err(bad(&format!(
                    "its bytes {begin}..{end} are not inside the {data_len} bytes of data"
                )));
            }
            let entry = Entry {
                dtype,
                shape,
                begin,
                end,
            };
            if let Some(size) = dtype_bytes(&entry.dtype) {
                let want = entry.elements().checked_mul(size);
                if want != Some((end - begin) as u128) {
                    return Err(bad(&format!(
                        "shape {:?} of {} takes {} bytes, but it has {}",
                        entry.shape,
                        entry.dtype,
                        want.map_or("more than 2^128".to_string(), |w| w.to_string()),
                        end - begin
                    )));
                }
            }
            entries.insert(name, entry);
        }
        let mut ranges: Vec<(u64, u64, &String)> =
            entries.iter().map(|(n, e)| (e.begin, e.end, n)).collect();
        ranges.sort();
        if let Some(w) = ranges.windows(2).find(|w| w[1].0 < w[0].1) {
            return Err(corrupt(format!(
                "tensors `{}` and `{}` overlap",
                w[0].2, w[1].2
            )));
        }
        Ok(Self {
            path: path.to_path_buf(),
            file,
            data_start,
            entries,
            metadata,
        })
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Every tensor's header entry, by name.
    pub fn entries(&self) -> &BTreeMap<String, Entry> {
        &self.entries
    }

    /// Every tensor's shape, by name.
    pub fn shapes(&self) -> HashMap<String, Vec<usize>> {
        self.entries
            .iter()
            .map(|(n, e)| (n.clone(), e.shape.clone()))
            .collect()
    }

    /// The header's `__metadata__` strings.
    pub fn metadata(&self) -> &HashMap<String, String> {
        &self.metadata
    }

    /// Values of every tensor in the file, by the header.
    pub fn elements(&self) -> u128 {
        self.entries.values().map(Entry::elements).sum()
    }

    /// Refuses a file holding fewer values than a model of `params` parameters needs (a
    /// config that claims more than its weights hold), before that model is built.
    pub fn check_holds(&self, params: u128, what: &str) -> Result<()> {
        if self.elements() < params {
            return Err(Error::Checkpoint {
                path: self.path.clone(),
                message: format!(
                    "holds {} values, but {what} describes a model of {params} parameters: the \
                     two do not belong together (a config.json of another model, or a vocab_size \
                     or size edited?)",
                    self.elements()
                ),
            });
        }
        Ok(())
    }

    /// Reads tensor `name` onto the CPU, in its stored dtype (one of [`ACCEPTED`]).
    pub fn read(&mut self, name: &str) -> Result<Tensor> {
        let entry = self.entries.get(name).ok_or_else(|| Error::Checkpoint {
            path: self.path.clone(),
            message: format!("has no tensor `{name}`"),
        })?;
        let Some(dtype) = dtype_of(&entry.dtype) else {
            return Err(Error::Checkpoint {
                path: self.path.clone(),
                message: format!(
                    "tensor `{name}` is stored as {}, a dtype poslab does not load: poslab \
                     reads weights in {}; convert the file (for example with torch: \
                     tensor.float())",
                    entry.dtype,
                    ACCEPTED.join(", ")
                ),
            });
        };
        let (begin, end, shape) = (entry.begin, entry.end, entry.shape.clone());
        let mut bytes = vec![0u8; (end - begin) as usize];
        self.file
            .seek(SeekFrom::Start(self.data_start + begin))
            .and_then(|_| self.file.read_exact(&mut bytes))
            .map_err(|e| Error::io(&self.path, e))?;
        Tensor::from_raw_buffer(&bytes, dtype, &shape, &Device::Cpu).map_err(|e| {
            Error::Checkpoint {
                path: self.path.clone(),
                message: format!("tensor `{name}`: {}", crate::error::without_backtrace(e)),
            }
        })
    }

    /// Reads every tensor, after checking that together they hold at most `max_elements`
    /// values (what the caller expects: a file that claims more is refused before anything
    /// is read).
    pub fn read_all(&mut self, max_elements: u128) -> Result<HashMap<String, Tensor>> {
        if self.elements() > max_elements {
            return Err(Error::Checkpoint {
                path: self.path.clone(),
                message: format!(
                    "holds {} values, more than the {max_elements} expected here: it does not \
                     belong to this model",
                    self.elements()
                ),
            });
        }
        let names: Vec<String> = self.entries.keys().cloned().collect();
        names
            .into_iter()
            .map(|n| Ok((n.clone(), self.read(&n)?)))
            .collect()
    }
}
